"""A registry row's spec is parsed once and shared (it is frozen): a changed spec is
read as changed, and sandboxes with the same spec stay separate rows."""

from __future__ import annotations

from corral.runtime.registry import Registry
from corral.schema import SandboxSpec


def test_a_changed_spec_is_read_again_and_equal_specs_stay_apart(tmp_path):
    reg = Registry(tmp_path / "registry.db")
    spec = SandboxSpec(memory_mb=128, tags=["a"], env={"K": "v"})
    reg.insert("sb-1", spec, "cg-1")
    reg.insert("sb-2", spec, "cg-2")
    one, two = reg.get("sb-1"), reg.get("sb-2")
    assert one is not None and two is not None
    assert (one.id, two.id) == ("sb-1", "sb-2")
    assert one.spec == spec and two.spec == spec
    longer = SandboxSpec.parse(spec.model_dump(), timeout=spec.timeout + 60)
    reg.set_spec("sb-1", longer)
    again = reg.get("sb-1")
    assert again is not None and again.spec.timeout == spec.timeout + 60
    other = reg.get("sb-2")
    assert other is not None and other.spec.timeout == spec.timeout  # untouched
    assert reg.get("sb-1", owner="t1") is None  # another tenant's row is still not read
