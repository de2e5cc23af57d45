"""Score a batch of model completions with a code-execution reward, printing as they land.

This is what a GRPO step does with ``reward_funcs=[corral.rl.code_reward(...)]``: every
completion's code runs in a fresh sandbox against its prompt's tests, at most
``--concurrency`` at once. The batch mixes what a policy really produces: correct
code, wrong code, partly right code, prose with no code, an endless loop (scored 0.0
at its timeout) and code that kills its own interpreter.

    python examples/reward_batch.py                        # 64 completions, the local daemon
    python examples/reward_batch.py --count 256 --concurrency 8 --mode binary
    python examples/reward_batch.py --kinds correct,wrong,partial   # no timeouts: throughput
    python examples/reward_batch.py --url unix:///tmp/corral.sock

Without ``--url`` (or ``CORRAL_URL``) the SDK uses the local daemon, starting it if
nothing answers.
"""

from __future__ import annotations

import argparse
import collections
import logging
import statistics
import time

import corral
from corral.rl import RewardOutcome, code_reward

# Tasks with their hidden tests, and the kinds of answers a policy writes for them.
TASKS = [
    ("Write add(a, b).", ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(0, 0) == 0"]),
    ("Write is_even(n).", ["assert is_even(2)", "assert not is_even(3)", "assert is_even(0)"]),
    ("Write rev(s).", ["assert rev('ab') == 'ba'", "assert rev('') == ''"]),
]
ANSWERS = {
    "correct": [
        "```python\ndef add(a, b):\n    return a + b\n```",
        "Here it is:\n```py\ndef is_even(n):\n    return n % 2 == 0\n```",
        "<answer>\ndef rev(s):\n    return s[::-1]\n</answer>",
    ],
    "wrong": [
        "```python\ndef add(a, b):\n    return a - b\n```",
        "```python\ndef is_even(n):\n    return n % 2 == 1\n```",
        "```python\ndef rev(s):\n    return s\n```",
    ],
    "partial": [
        "```python\ndef add(a, b):\n    return abs(a) + b\n```",
        "```python\ndef is_even(n):\n    return n == 2\n```",
        "```python\ndef rev(s):\n    return s[::-1] or None\n```",
    ],
    "no code": ["I would add the numbers.", "Even numbers are divisible by two.", "Reverse it."],
    "endless loop": [
        f"```python\ndef {name}(*args):\n    while True:\n        pass\n```"
        for name in ("add", "is_even", "rev")
    ],
    "crash": ["```python\nimport os\nos._exit(3)\n```"] * 3,
}
KINDS = list(ANSWERS)


def make_batch(count: int, kinds_used: list[str]) -> tuple[list[str], list[list[str]], list[str]]:
    completions, tests, kinds = [], [], []
    for i in range(count):
        task = i % len(TASKS)
        kind = kinds_used[(i // len(TASKS)) % len(kinds_used)]
        completions.append(ANSWERS[kind][task])
        tests.append(TASKS[task][1])
        kinds.append(kind)
    return completions, tests, kinds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=64, help="completions (default 64)")
    parser.add_argument("--concurrency", type=int, default=None,
                        help="sandboxes at once (default: four per core)")
    parser.add_argument("--mode", choices=["binary", "fraction"], default="fraction")
    parser.add_argument("--timeout", type=float, default=2.0,
                        help="seconds per completion (default 2)")
    parser.add_argument("--kinds", default=",".join(KINDS),
                        help=f"kinds of answers in the batch, comma-separated (default: {','.join(KINDS)})")
    parser.add_argument("--url", help="the daemon (default: CORRAL_URL, else the local one)")
    args = parser.parse_args()
    kinds_used = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if not kinds_used or set(kinds_used) - set(KINDS):
        parser.error(f"--kinds takes some of: {', '.join(KINDS)}")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    reward = code_reward(
        args.mode, timeout=args.timeout, concurrency=args.concurrency, url=args.url,
        tags=["example=reward_batch"],
    )
    completions, tests, kinds = make_batch(args.count, kinds_used)
    print(f"{reward!r}: {args.count} completions")

    start = time.perf_counter()

    def show(o: RewardOutcome) -> None:
        score = "None" if o.reward is None else f"{o.reward:.2f}"
        print(f"#{o.index:<4} {kinds[o.index]:<13} reward {score:<5} "
              f"{(o.sandbox_id or '-'):<16} {o.duration * 1000:6.0f} ms  {o.reason}", flush=True)

    outcomes = reward.evaluate(completions, tests, on_result=show)
    elapsed = time.perf_counter() - start

    print("\nMean reward per kind of answer")
    by_kind: dict[str, list[float]] = collections.defaultdict(list)
    for o in outcomes:
        if o.reward is not None:
            by_kind[kinds[o.index]].append(o.reward)
    for kind in KINDS:
        if by_kind[kind]:
            print(f"  {kind:<13} {statistics.fmean(by_kind[kind]):.2f}  (n={len(by_kind[kind])})")
    s = reward.stats
    print(f"\n{args.count} completions in {elapsed:.2f} s: {args.count / elapsed:.1f} completions/s "
          f"at concurrency {reward.concurrency}; {s.sandboxes_created} sandboxes created, "
          f"{s.sandboxes_deleted} deleted, {s.timeouts} timeouts, {s.no_code} without code, "
          f"{s.infra_failures} infrastructure failures")
    with corral.Client(args.url) as client:
        left = corral.Sandbox.list(tags=["example=reward_batch"], client=client)
    print(f"sandboxes left on the daemon: {len(left)}")
    return 0 if s.infra_failures == 0 and not left else 1


if __name__ == "__main__":
    raise SystemExit(main())
