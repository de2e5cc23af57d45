"""Red-team: the kernel judge (docs/gpus.md, "Kernel rewards") on the CPU with the host's
PyTorch, unprivileged as in a sandbox (see tests/rl/test_kernel_reward.py)."""

from __future__ import annotations

import pytest

from tests.rl.test_kernel_reward import HEADER, scored

pytest.importorskip("torch", reason="the kernel judge needs PyTorch (the trl extra)")

# 60 times the work of the reference, but each input set is computed once. When the
# timed repeats reused the same staged tensors, a memo keyed by them (holding them, so no
# id is reused) answered every repeat after the warm-up from memory, with right outputs
# and so right digests: measured 100x "faster" than the reference, the maximum reward.
# Each hit is written down, so the test does not depend on the clock.
MEMO_BY_OBJECT = HEADER + """
    memo = {}
    def forward(self, a, b):
        key = (id(a), id(b))
        if key in ModelNew.memo:
            with open(HITS, "a") as f:
                f.write("hit\\n")
        else:
            for _ in range(60):
                x = torch.relu(a @ b + self.bias) * self.scale
            ModelNew.memo[key] = (a, b, x)
        return ModelNew.memo[key][2]
"""


def memo_hits(candidate: str, tmp_path) -> int:
    """How many timed runs ``candidate`` (correct) answered from its memo."""
    hits = tmp_path / "hits"
    hits.touch(mode=0o666)
    tmp_path.chmod(0o777)
    out = scored(f"HITS = {str(hits)!r}\n" + candidate)
    assert out.correct, out
    return len(hits.read_text().split())


def test_memoizing_the_staged_inputs_across_timed_repeats_has_nothing_to_answer(tmp_path):
    assert memo_hits(MEMO_BY_OBJECT, tmp_path) == 0


# The same memo, filled while the judge stages the inputs (not timed): the worker moves
# each staged tensor to the device with Tensor.to, which the candidate wraps; once a set
# is complete it computes the output there, keyed by the inputs' bytes, and a timed run
# on inputs with those bytes answers from the memo. Against the judge that staged the
# inputs as they are, every timed run was a hit. Staged masked (the mask's seed comes
# with the timed request), what it computes from is noise.
PRECOMPUTES_WHILE_STAGING = HEADER + """
    memo, pending, me = {}, [], None
    def forward(self, a, b):
        ModelNew.me = self
        key = ModelNew.key(a, b)
        if key in ModelNew.memo:
            with open(HITS, "a") as f:
                f.write("hit\\n")
            return ModelNew.memo[key]
        return ModelNew.work(self, a, b)
    @staticmethod
    def key(a, b):
        import ctypes
        return tuple(ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())
                     for t in (a.contiguous(), b.contiguous()))
    @staticmethod
    def work(self, a, b):
        for _ in range(60):
            x = torch.relu(a @ b + self.bias) * self.scale
        return x
_to = torch.Tensor.to
def to(t, *args, **kw):
    import sys
    out = _to(t, *args, **kw)
    f = sys._getframe()
    while f is not None and f.f_code.co_name != "worker":
        f = f.f_back
    if f is None or f.f_locals.get("op") != "stage" or ModelNew.me is None:
        return out
    ModelNew.pending.append(out)
    if len(ModelNew.pending) == 2:
        try:  # whatever form the staged tensors have, taken as the inputs they become
            a, b = (x if x.dtype == torch.float32 else x.view(torch.float32).reshape(64, 64)
                    for x in ModelNew.pending)
            with torch.no_grad():
                ModelNew.memo[ModelNew.key(a, b)] = ModelNew.work(ModelNew.me, a, b)
        except Exception:
            pass
        ModelNew.pending = []
    return out
torch.Tensor.to = to
"""


def test_precomputing_while_the_inputs_are_staged_has_nothing_to_answer(tmp_path):
    assert memo_hits(PRECOMPUTES_WHILE_STAGING, tmp_path) == 0


# Right in the correctness trials; in the timed runs (told apart by the worker's frame)
# it computes 48 of the 64 rows and fills the rest with copies: a quarter of the work
# skipped. Sums, sums of squares and max |x| of such outputs stayed within the digests'
# old tolerance (10% of each, plus 1000 * atol) in ~99% of the checks.
SKIPS_A_QUARTER_WHEN_TIMED = HEADER + """
    def forward(self, a, b):
        import sys
        f, op = sys._getframe(), None
        while f is not None:
            if f.f_code.co_name == "worker":
                op = f.f_locals.get("op")
            f = f.f_back
        if op != "time":
            return torch.relu(a @ b + self.bias) * self.scale
        part = torch.relu(a[:48] @ b + self.bias) * self.scale
        return torch.cat([part, part[:16]])
"""


def test_skipping_part_of_the_work_in_the_timed_runs_scores_zero():
    out = scored(SKIPS_A_QUARTER_WHEN_TIMED)
    assert out.status == "wrong" and out.reward == 0.0 and "timed" in (out.reason or ""), out


# A wrong candidate answers with a descriptor whose shape does not match its bytes (its
# worker is its own process: it writes the wire itself). The judge's reshape raised an
# exception it did not expect: "judge_error", reward None, instead of the 0 it earned.
MALFORMED_ANSWER = HEADER + """
    def forward(self, a, b):
        import sys, json, struct, os
        f = sys._getframe()
        while f is not None and f.f_code.co_name != "worker":
            f = f.f_back
        header = json.dumps({"ok": True, "tensors": [
            {"dtype": "float32", "shape": [3], "nbytes": 8}]}).encode()
        os.write(f.f_locals["wfd"], struct.pack(">I", len(header)) + header + bytes(8))
        os._exit(0)
"""


def test_a_malformed_answer_scores_zero_not_none():
    out = scored(MALFORMED_ANSWER)
    assert out.reward == 0.0 and out.status == "runtime_error", out
