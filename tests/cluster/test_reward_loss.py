"""A reward function whose sandboxes are on a node that dies (``Cluster.remove_node``)
scores those completions again on other nodes: an infrastructure failure, retried,
never a reward of 0 (nor None while retries are left)."""

from __future__ import annotations

import threading

import corral
from corral.rl import code_reward
from tests.cluster.conftest import until

NAME = "cluster-loss"
CODE = "```python\ndef f(x):\n    return 2 * x\n```"
TESTS = ["import time\ntime.sleep(10)", "assert f(2) == 4"]


def test_a_reward_on_a_lost_node_is_scored_elsewhere(corral_cluster):
    doomed = corral_cluster.workers[0]
    doomed_id = corral_cluster.worker_id(doomed)
    url = f"ray://{corral_cluster.address}"
    reward = code_reward(timeout=60, url=url, name=NAME, memory_mb=64, concurrency=6,
                         retries=3)
    seen_on: set[str] = set()

    def kill_when_busy() -> None:
        def busy() -> bool:  # all six are being scored, some on the doomed node
            with corral.Client(url) as client:
                live = corral.Sandbox.list(tags=[f"reward={NAME}"], client=client)
            seen_on.update(sb.info.node for sb in live)
            return len(live) >= 6 and doomed_id in seen_on

        try:
            until(busy, "completions scored on the doomed node")
        finally:
            corral_cluster.remove_worker(doomed)

    killer = threading.Thread(target=kill_when_busy)
    killer.start()
    try:
        got = reward(completions=[CODE] * 6, tests=[TESTS] * 6)
    finally:
        killer.join()
    outcomes = reward.last_outcomes
    assert got == [1.0] * 6, [(o.reward, o.reason, o.infra_error) for o in outcomes]
    assert reward.stats.infra_failures == 0 and reward.stats.infra_retries >= 1
    assert any(o.attempts > 1 for o in outcomes)
    assert doomed_id in seen_on

    corral_cluster.add_worker(instead_of=doomed)
