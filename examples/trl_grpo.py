"""Two GRPO training steps with TRL, scored by code run in corral sandboxes. CPU only.

Two ways to plug corral into ``trl.GRPOTrainer``:

- ``reward_funcs=[corral.rl.code_reward(...)]`` (default): every completion's code
  runs in a fresh sandbox against its prompt's tests (dataset column ``tests``);
- ``--env``: ``environment_factory=SandboxToolEnv``: every rollout gets one sandbox
  that persists across the model's tool calls (``write_file``, ``bash``, ...) and is
  scored by the hidden tests at the end.

The model is a 2-layer Llama with random weights and a tokenizer built here — no model
hub, no download — so what it writes is noise; to make that noise executable, its
vocabulary has whole Python statements (``"ok=1;"``) and whole tool calls as single
tokens, and generation is restricted to them. Swap in a real model and tokenizer and
nothing else changes.

    python examples/trl_grpo.py                  # code_reward, 2 steps
    python examples/trl_grpo.py --env            # SandboxToolEnv, 2 steps
    python examples/trl_grpo.py --url unix:///tmp/corral.sock

Needs ``pip install 'corral[trl]'`` (CPU torch, transformers, trl).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from functools import partial

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # environment_factory is "experimental"

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl.chat_template_utils import qwen2_5_chat_template  # noqa: E402

import corral  # noqa: E402
from corral.rl import RewardOutcome, SandboxToolEnv, code_reward  # noqa: E402

# Reward mode: any sequence of these is a valid program; the tests look at `ok` and `x`.
STATEMENTS = ["ok=1;", "ok=0;", "x=2;", "x=x+1;", "pass;"]
REWARD_DATA = {
    "prompt": ["Set ok to 1.", "Set x to 2 and ok to 1."],
    "tests": [["assert ok == 1"], ["assert x == 2", "assert ok == 1"]],
}
# Tool mode: the model writes one of two solutions with a tool call; the tests decide.
GOOD = "def double(x):\n    return 2 * x\n"
BAD = "def double(x):\n    return x + 2\n"
ENV_PROMPT = "Write double(x) in solution.py."
ENV_TESTS = ["from solution import double\nassert double(3) == 6", "assert double(0) == 0"]


def tool_call(content: str) -> str:
    """A Qwen-style tool call writing ``content`` to solution.py, as the model emits it."""
    call = {"name": "write_file", "arguments": {"path": "solution.py", "content": content}}
    return "<tool_call>\n" + json.dumps(call) + "\n</tool_call>"


TOOL_CALLS = [tool_call(GOOD), tool_call(BAD)]


def build_tokenizer(tools: list | None = None) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained here, in milliseconds, on the chat prompts the
    model will see (so they take few tokens), with the statements and tool calls as
    extra single tokens and a chat template that supports tool calling (Qwen2.5's).
    Byte-level: any text round-trips exactly, as TRL's chat-template checks need."""
    specials = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    corpus = [_render_prompts(tools or _env_tools())] * 2
    tk.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=1000, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    ))
    tk.add_tokens([AddedToken(t, normalized=False) for t in STATEMENTS + TOOL_CALLS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="<|endoftext|>", eos_token="<|im_end|>",
        padding_side="left",
    )
    tokenizer.chat_template = qwen2_5_chat_template
    return tokenizer


def _env_tools() -> list:
    env = SandboxToolEnv()
    return [env.bash, env.read_file, env.write_file, env.run_tests]


def _render_prompts(tools: list) -> str:
    """The text of the prompts of both modes, as the chat template renders them (the
    throwaway tokenizer is there because rendering is a tokenizer method)."""
    tk = Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    render = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>")
    render.chat_template = qwen2_5_chat_template
    messages = [{"role": "user", "content": ENV_PROMPT}]
    text = render.apply_chat_template(messages, tools=tools, tokenize=False,
                                      add_generation_prompt=True)
    return text + "\n".join(REWARD_DATA["prompt"])


def build_model(tokenizer: PreTrainedTokenizerFast, seed: int = 0) -> LlamaForCausalLM:
    """A 2-layer Llama with random weights (about 64k parameters)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=4096,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None, tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def only_tokens(tokenizer: PreTrainedTokenizerFast, allowed: list[str]) -> list[int]:
    """The ids to suppress so that generation picks only ``allowed`` (and EOS)."""
    keep = set(tokenizer.convert_tokens_to_ids(allowed)) | {tokenizer.eos_token_id}
    return [i for i in range(len(tokenizer)) if i not in keep]


def grpo_config(steps: int, output_dir: str, **overrides) -> GRPOConfig:
    """Tiny, CPU-only settings: 2 prompts x 4 generations per step."""
    settings = dict(
        output_dir=output_dir, max_steps=steps, per_device_train_batch_size=8,
        num_generations=4, max_completion_length=12, learning_rate=1e-3, use_cpu=True,
        report_to=[], logging_steps=1, save_strategy="no", disable_tqdm=True, seed=0,
        activation_checkpointing=False,  # on by default; a waste of CPU for a tiny model
    )
    settings.update(overrides)
    return GRPOConfig(**settings)


def reward_trainer(
    steps: int, url: str | None, output_dir: str, on_result=None
) -> tuple[GRPOTrainer, object]:
    """GRPO with a code-execution reward: one fresh sandbox per completion."""
    tokenizer = build_tokenizer()
    # A random model cannot write a code fence: score the whole completion as code.
    reward = code_reward(
        "fraction", timeout=10, fallback="raw", url=url, on_result=on_result,
        tags=["example=trl_grpo"],
    )
    args = grpo_config(steps, output_dir, generation_kwargs={
        "suppress_tokens": only_tokens(tokenizer, STATEMENTS),
        "begin_suppress_tokens": [tokenizer.eos_token_id],
    })
    dataset = Dataset.from_dict({k: v * 4 for k, v in REWARD_DATA.items()})
    trainer = GRPOTrainer(
        model=build_model(tokenizer), reward_funcs=[reward], args=args,
        train_dataset=dataset, processing_class=tokenizer,
    )
    return trainer, reward


def env_trainer(
    steps: int, url: str | None, output_dir: str, env_class: type[SandboxToolEnv] = SandboxToolEnv
) -> GRPOTrainer:
    """GRPO with tools: one sandbox per rollout, reward from the hidden tests."""
    tokenizer = build_tokenizer()
    args = grpo_config(steps, output_dir, max_completion_length=64, max_tool_calling_iterations=1,
                       generation_kwargs={
                           "suppress_tokens": only_tokens(tokenizer, TOOL_CALLS),
                           "begin_suppress_tokens": [tokenizer.eos_token_id],
                       })
    prompt = [{"role": "user", "content": ENV_PROMPT}]
    dataset = Dataset.from_dict({"prompt": [prompt] * 8, "tests": [ENV_TESTS] * 8})
    return GRPOTrainer(
        model=build_model(tokenizer), args=args, train_dataset=dataset,
        processing_class=tokenizer,
        environment_factory=partial(env_class, url=url, tags=["example=trl_grpo"]),
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", action="store_true", help="use environment_factory (tools)")
    parser.add_argument("--steps", type=int, default=2, help="training steps (default 2)")
    parser.add_argument("--url", help="the daemon (default: CORRAL_URL, else the local one)")
    args = parser.parse_args()

    def show(o: RewardOutcome) -> None:
        print(f"  {o.sandbox_id or '-':<16} reward {o.reward}  code {o.code!r}  ({o.reason})")

    with tempfile.TemporaryDirectory() as out:
        if args.env:
            trainer = env_trainer(args.steps, args.url, out)
        else:
            trainer, reward = reward_trainer(args.steps, args.url, out, on_result=show)
        start = time.perf_counter()
        trainer.train()
        elapsed = time.perf_counter() - start
    name = "SandboxToolEnv" if args.env else reward.__name__
    for entry in trainer.state.log_history:
        if f"rewards/{name}/mean" in entry:
            tools = entry.get("tools/call_frequency")
            extra = f", tool calls per rollout {tools:.2f}" if tools is not None else ""
            print(f"step {entry['step']}: reward mean {entry[f'rewards/{name}/mean']:.3f} "
                  f"std {entry[f'rewards/{name}/std']:.3f}, loss {entry['loss']:.4f}{extra}")
    if args.env:
        envs = trainer._environment_pool[None]
        used = sum(len(e.sandbox_ids) for e in envs)
        print(f"{len(envs)} environments ran {sum(e.rollouts for e in envs)} rollouts "
              f"in {used} sandboxes")
    else:
        print(f"{reward.stats.completions} completions run in {reward.stats.sandboxes_created} "
              f"sandboxes")
    print(f"{args.steps} GRPO steps in {elapsed:.1f} s")
    with corral.Client(args.url) as client:
        left = corral.Sandbox.list(tags=["example=trl_grpo"], client=client)
    print(f"sandboxes left on the daemon: {len(left)}")
    return 0 if not left else 1


if __name__ == "__main__":
    raise SystemExit(main())
