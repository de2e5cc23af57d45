"""Attack: one tenant's replies made every other tenant's commands get 429.

A reply's JSON may be up to ~6 times the output it carries (``\\u0001`` for a control
byte): ``OutputHold.fit`` counts it, "even past the budget, since those bytes exist
already: the next reservation is refused instead". But it counted the excess in the
daemon's total too: a tenant holding its share (half the daemon's) of control bytes,
its client reading none of the replies, put the daemon's gauge at three times its
total, and every other tenant's command was refused (not even a floor free) for as
long as that client sat on its connections. The excess past the tenant's own free room
now counts against that tenant only (its next reservation is refused), never against
the room of the others.
"""

from __future__ import annotations

import pytest

from corral.errors import OutputBudgetExceeded
from corral.runtime.output_budget import MIN_GRANT, OutputBudget

MiB = 1 << 20


def test_a_reply_past_its_tenants_share_leaves_the_others_room():
    budget = OutputBudget(total=8 * MiB, per_tenant=4 * MiB)
    holds = [budget.reserve("mallory", 1 << 30) for _ in range(2)]
    holds[0].grow(4 * MiB)  # her output fills her share
    assert budget.by_tenant["mallory"] == budget.used == 4 * MiB
    for hold in holds:  # her replies' JSON: six times the output
        hold.fit(6 * hold.nbytes)
    with pytest.raises(OutputBudgetExceeded):  # her own next command waits
        budget.reserve("mallory", MIN_GRANT)
    # alice's commands still run, with as much room as the daemon had left for her
    alice = budget.reserve("alice", 1 << 30)
    assert alice.grow(8 * MiB) == 4 * MiB - 2 * MIN_GRANT
    alice.release()
    for hold in holds:
        hold.shrink(hold.nbytes // 2)  # a reply partly written
        hold.release()
    assert budget.used == budget.over == 0 and not budget.by_tenant
