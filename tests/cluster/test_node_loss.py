"""A node dies (``Cluster.remove_node``: its raylet and everything on it): calls to its
sandboxes raise SandboxLost naming it, placement stops choosing it, an episode run
still completes every episode, and a node that joins later gets a daemon."""

from __future__ import annotations

import threading

import corral
from corral.rl.episodes import EpisodeStatus, run_episodes
from tests.cluster.conftest import until

TAG = "test-cluster-loss"


def test_node_loss(corral_cluster):
    doomed = corral_cluster.workers[0]
    doomed_id = corral_cluster.worker_id(doomed)
    with corral.Client(f"ray://{corral_cluster.address}") as client:
        lost = corral.Sandbox.create(memory_mb=64, tags=[TAG], node=doomed_id, client=client)
        kept = corral.Sandbox.create(memory_mb=64, tags=[TAG], node=corral_cluster.head_id(),
                                     client=client)
        episodes_on: list[str] = []

        def episode(sb: corral.Sandbox, seed: int) -> dict:
            episodes_on.append(sb.info.node)
            # On the doomed node the command runs until the node dies under it: a
            # command of a few seconds there could end before the kill on a loaded host
            # (then nothing was lost, and no episode tried again).
            hold = "sleep 600; " if sb.info.node == doomed_id else ""
            r = sb.exec(f"{hold}echo {seed}", timeout=600, check=True)
            return {"reward": float(r.stdout)}

        def kill_when_busy() -> None:
            def busy() -> bool:  # all six started, some on the doomed node
                return len(episodes_on) >= 6 and doomed_id in episodes_on

            try:
                until(busy, "episodes running on the doomed node")
            finally:
                corral_cluster.remove_worker(doomed)

        killer = threading.Thread(target=kill_when_busy)
        killer.start()
        try:
            records = list(run_episodes(
                episode, range(6), image="python", sandbox={"memory_mb": 64, "tags": [TAG]},
                concurrency=6, retries=3, client=client,
            ))
        finally:
            killer.join()
        assert sorted(r.seed for r in records) == list(range(6))
        assert all(r.status is EpisodeStatus.OK and r.reward == r.seed for r in records), [
            (r.status, r.error) for r in records]
        assert any(r.attempts > 1 for r in records), "no episode ran on the node that died"
        assert doomed_id in episodes_on

        def lost_error() -> BaseException | None:
            try:
                lost.exec("true", timeout=10)
            except corral.SandboxLost as exc:
                return exc
            except corral.DaemonUnavailable:
                return None  # Ray has not declared the node dead yet
            return None

        exc = until(lost_error, "SandboxLost")
        assert doomed_id in str(exc) and exc.details["node"] == doomed_id
        assert kept.exec("echo still", timeout=30).stdout == "still\n"
        after = [corral.Sandbox.create(memory_mb=64, tags=[TAG], client=client)
                 for _ in range(4)]
        assert doomed_id not in {sb.info.node for sb in after}
        for sb in [kept, *after]:
            sb.delete()

    # A node that joins later gets a daemon from the supervisor.
    corral_cluster.add_worker(instead_of=doomed)
