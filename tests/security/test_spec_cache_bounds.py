"""Red team of the registry's spec-parse cache (runtime/registry.py, issue 30): each read
of a sandbox's row reuses the spec parsed from the same text.

- Poisoning across tenants: the cache is keyed on the row's whole text, and the tenant
  is part of it, so two tenants' identical specs are two entries: a read answers each
  row with its own tenant, never another's parse.
- Memory: the cache held every text and its parse, whatever its size, until 4096 of
  them. A tenant that created sandboxes with megabytes of environment each (a create
  body may be up to --max-upload-bytes) left the daemon holding them after they ended:
  a real daemon grew by 361 MB for 16 such sandboxes of 8 MB, all deleted. Now a large
  spec is parsed at each read and never kept, and the cache is bounded in characters
  (runtime/registry.py's SpecCache).
Real SQLite, the engine's own Registry; memory counted by tracemalloc (no timing).
"""

from __future__ import annotations

import gc
import tracemalloc

from corral.runtime.registry import Registry
from corral.schema import SandboxSpec

BIG = 1 << 20  # one environment value
ROUNDS = 16


def test_a_tenants_spec_parse_never_answers_for_anothers_row(tmp_path):
    reg = Registry(tmp_path / "state.db")
    try:
        for i, tenant in enumerate(("alice", "bob", None)):
            reg.insert(f"sb-{i:012x}", SandboxSpec(env={"A": "1"}, tenant=tenant), "cg")
        for _ in range(2):  # the second time from the cache
            got = [reg.get(f"sb-{i:012x}").spec.tenant for i in range(3)]
            assert got == ["alice", "bob", None]
            assert reg.get("sb-000000000000", owner="bob") is None
    finally:
        reg.close()


def test_large_specs_are_not_kept_after_their_read(tmp_path):
    reg = Registry(tmp_path / "state.db")
    try:
        for i in range(ROUNDS):
            reg.insert(f"sb-{i:012x}", SandboxSpec(env={"BIG": chr(97 + i) * BIG},
                                                   tenant="alice"), "cg")
        gc.collect()
        tracemalloc.start()
        try:
            for i in range(ROUNDS):
                assert len(reg.get(f"sb-{i:012x}").spec.env["BIG"]) == BIG
            assert len(reg.list()) == ROUNDS
            gc.collect()
            kept, _ = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    finally:
        reg.close()
    print(f"{ROUNDS} specs of {BIG >> 20} MB read: {kept >> 20} MB kept")
    assert kept < 2 * BIG, f"the registry kept {kept >> 20} MB of specs it had read"

