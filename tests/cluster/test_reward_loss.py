"""A reward function whose sandboxes are on a node that dies (``Cluster.remove_node``)
scores those completions again on other nodes: an infrastructure failure, retried,
never a reward of 0 (nor None while retries are left)."""

from __future__ import annotations

import threading
import time

import corral
from corral.rl import code_reward
from tests.cluster.conftest import POLLS

NAME = "cluster-loss"
CODE = "```python\ndef f(x):\n    return 2 * x\n```"
GO = "/tmp/corral-go"
# The first test holds until the test lets it go: on the doomed node never, so that a
# completion there is still being scored when the node dies (a test of a few seconds
# could end before the kill on a loaded host: then nothing was lost, nothing retried).
HOLD = f"""import os, time
for _ in range(6000):
    if os.path.exists({GO!r}):
        break
    time.sleep(0.1)
else:
    raise AssertionError("never let go")"""
TESTS = [HOLD, "assert f(2) == 4"]


def test_a_reward_on_a_lost_node_is_scored_elsewhere(corral_cluster):
    doomed = corral_cluster.workers[0]
    doomed_id = corral_cluster.worker_id(doomed)
    url = f"ray://{corral_cluster.address}"
    reward = code_reward(timeout=600, url=url, name=NAME, memory_mb=64, concurrency=6,
                         retries=3)
    seen_on: set[str] = set()
    done = threading.Event()
    killed = threading.Event()

    def release_and_kill() -> None:
        """Lets go every completion off the doomed node (retries included, until the
        reward returns); kills the node once one is being scored on it."""
        released: set[str] = set()
        try:
            with corral.Client(url) as client:
                for _ in range(POLLS * 10):
                    if done.is_set():
                        return
                    try:
                        live = corral.Sandbox.list(tags=[f"reward={NAME}"], client=client)
                    except corral.CorralError:
                        live = []  # the cluster still settling the node's loss
                    seen_on.update(sb.info.node for sb in live)
                    for sb in live:
                        if sb.info.node != doomed_id and sb.id not in released:
                            try:
                                sb.files.write(GO, "go")
                                released.add(sb.id)
                            except corral.CorralError:
                                pass  # asked again at the next poll
                    if not killed.is_set() and any(sb.info.node == doomed_id for sb in live):
                        killed.set()
                        corral_cluster.remove_worker(doomed)
                    time.sleep(0.1)
        finally:
            if not killed.is_set():
                killed.set()
                corral_cluster.remove_worker(doomed)

    helper = threading.Thread(target=release_and_kill)
    helper.start()
    try:
        got = reward(completions=[CODE] * 6, tests=[TESTS] * 6)
    finally:
        done.set()
        helper.join()
    outcomes = reward.last_outcomes
    assert got == [1.0] * 6, [(o.reward, o.reason, o.infra_error) for o in outcomes]
    assert reward.stats.infra_failures == 0 and reward.stats.infra_retries >= 1
    assert any(o.attempts > 1 for o in outcomes)
    assert doomed_id in seen_on

    corral_cluster.add_worker(instead_of=doomed)
