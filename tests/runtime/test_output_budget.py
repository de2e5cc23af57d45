"""The output budget's arithmetic (runtime/output_budget.py): a command reserves both
streams' cap, a command that does not fit gets a lower cap (never under MIN_GRANT), and
under that it is refused, typed; tenants are counted apart, releases are idempotent."""

from __future__ import annotations

import pytest

from corral.errors import OutputBudgetExceeded, error_from_dict
from corral.runtime.output_budget import MIN_GRANT, OutputBudget, host_output_bytes, memory_limit

MiB = 1 << 20


def test_a_command_that_fits_gets_what_it_asked():
    budget = OutputBudget(total=64 * MiB, per_tenant=32 * MiB)
    hold = budget.reserve("alice", 4 * MiB)
    assert (hold.max_output, hold.limited, hold.nbytes) == (4 * MiB, False, 8 * MiB)
    assert budget.used == 8 * MiB and budget.by_tenant == {"alice": 8 * MiB}
    hold.release()
    hold.release()  # twice: given back once
    assert budget.used == 0 and budget.by_tenant == {}


def test_a_command_that_does_not_fit_gets_a_lower_cap_then_a_typed_refusal():
    budget = OutputBudget(total=64 * MiB, per_tenant=16 * MiB)
    first = budget.reserve("alice", 1 << 30)  # 1 GiB asked: the tenant's share is 16 MiB
    assert first.limited and first.max_output == 8 * MiB
    with pytest.raises(OutputBudgetExceeded) as err:
        budget.reserve("alice", 1 * MiB)
    assert err.value.status == 429 and err.value.code == "output_budget_exceeded"
    assert "its tenant's" in str(err.value) and "max_output" in str(err.value)
    assert err.value.details["tenant_limit"] == 16 * MiB
    # the error crosses the wire as itself
    again = error_from_dict({"code": err.value.code, "message": str(err.value)})
    assert isinstance(again, OutputBudgetExceeded)
    # another tenant is not touched by alice's share
    bob = budget.reserve("bob", 4 * MiB)
    assert not bob.limited
    first.release()
    assert not budget.reserve("alice", 1 * MiB).limited


def test_the_daemons_total_binds_every_tenant_and_says_so():
    budget = OutputBudget(total=3 * MIN_GRANT, per_tenant=2 * MIN_GRANT)
    budget.reserve("alice", MIN_GRANT)
    with pytest.raises(OutputBudgetExceeded) as err:
        budget.reserve("bob", MIN_GRANT)  # bob has its share, the daemon has not
    assert "the daemon's" in str(err.value)
    zero = budget.reserve("bob", 0)  # no output kept: always fits
    assert zero.nbytes == 0 and not zero.limited


def test_a_reply_holds_only_its_real_size():
    budget = OutputBudget(total=4 * MiB, per_tenant=4 * MiB)
    hold = budget.reserve(None, 2 * MiB)
    hold.shrink(100)
    hold.shrink(1000)  # never grows
    assert budget.used == 100 and budget.by_tenant == {None: 100}
    hold.release()
    assert budget.used == 0


def test_a_budget_smaller_than_one_grant_is_refused():
    with pytest.raises(ValueError):
        OutputBudget(total=MIN_GRANT)


def test_a_process_takes_what_fits_and_gives_it_back():
    budget = OutputBudget(total=4 * MiB, per_tenant=2 * MiB)
    assert budget.take("alice", 3 * MiB) == 2 * MiB  # her share
    assert budget.take("alice", 1) == 0  # spent: dropped, never refused
    assert budget.take("bob", 3 * MiB) == 2 * MiB  # the daemon's rest
    budget.give("alice", 2 * MiB)
    budget.give("bob", 2 * MiB)
    assert budget.used == 0 and budget.by_tenant == {}


def test_the_default_follows_the_daemons_own_memory_limit(tmp_path):
    """A daemon in a container: its cgroup's limit (v2 or v1, or an ancestor's) is what
    it may use, not the host's RAM."""
    ram = memory_limit(tmp_path / "none", tmp_path)
    assert ram > 0 and memory_limit() <= ram and host_output_bytes() <= ram // 8
    (tmp_path / "v2").write_text("0::/box/daemon\n")
    (tmp_path / "box" / "daemon").mkdir(parents=True)
    (tmp_path / "box" / "daemon" / "memory.max").write_text("max\n")
    (tmp_path / "box" / "memory.max").write_text(f"{512 * MiB}\n")
    assert memory_limit(tmp_path / "v2", tmp_path) == min(ram, 512 * MiB)
    (tmp_path / "v1").write_text("5:cpu,cpuacct:/x\n4:memory:/box\n")
    (tmp_path / "memory" / "box").mkdir(parents=True)
    (tmp_path / "memory" / "box" / "memory.limit_in_bytes").write_text(f"{256 * MiB}\n")
    assert memory_limit(tmp_path / "v1", tmp_path) == min(ram, 256 * MiB)
