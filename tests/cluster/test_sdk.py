"""The SDK, unchanged, on a cluster: ``ray://`` routes every call to the right node."""

from __future__ import annotations

import pickle
from collections import Counter

import pytest

import corral
from corral.cluster.ids import node_tag

TAG = "test-cluster-sdk"


@pytest.fixture
def client(corral_cluster):
    with corral.Client(f"ray://{corral_cluster.address}") as c:
        yield c
        for sb in corral.Sandbox.list(tags=[TAG], client=c):
            sb.delete()


def _free_slots(client) -> dict[str, int]:
    """Each node's free sandbox places as the client's router reads them now."""
    router = client.router
    router._loaded_at = float("-inf")  # read every node's load now
    _, rooms = router._rooms(None)
    return {n: r.slots for n, r in rooms.items()}


def test_placement_spreads_and_calls_go_to_the_node(client, corral_cluster):
    # an earlier module's sandboxes may still hold places on a node (they are counted):
    # the creates fill the nodes to the same level, whatever it was before
    before = _free_slots(client)
    made = [corral.Sandbox.create(memory_mb=64, tags=[TAG], client=client) for _ in range(30)]
    per_node = Counter(sb.info.node for sb in made)
    assert sorted(per_node) == corral_cluster.node_ids()
    left = {n: before[n] - per_node[n] for n in before}
    assert max(left.values()) - min(left.values()) <= 1, (before, per_node)  # 10 each
    for sb in made:
        assert sb.id.startswith(f"sb-{node_tag(sb.info.node)}-")
    r = made[0].exec(["sh", "-c", "echo hi"], timeout=30)
    assert r.stdout == "hi\n"
    listed = corral.Sandbox.list(tags=[TAG], client=client)
    assert sorted(sb.id for sb in listed) == sorted(sb.id for sb in made)
    assert {sb.info.node for sb in listed} == set(corral_cluster.node_ids())


def test_pinning_and_bad_node(client, corral_cluster):
    node = corral_cluster.node_ids()[-1]
    sb = corral.Sandbox.create(memory_mb=64, tags=[TAG], node=node, client=client)
    assert sb.info.node == node
    assert corral.Sandbox.connect(sb.id, client=client).info.node == node
    with pytest.raises(corral.InvalidArgument, match="corral cluster status"):
        corral.Sandbox.create(memory_mb=64, node="f" * 56, client=client)


def test_a_handle_pickles(client):
    sb = corral.Sandbox.create(memory_mb=64, tags=[TAG], client=client)
    copy = pickle.loads(pickle.dumps(sb))
    assert copy.id == sb.id and copy.client.url == client.url
    assert copy.exec("echo ok", timeout=30).stdout == "ok\n"


def test_a_ray_task_gets_a_local_sandbox_and_uses_a_pickled_one(client, corral_cluster):
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=0)
    def make_here() -> tuple[str, str, str]:
        with corral.Client("ray://auto") as c:
            sb = corral.Sandbox.create(memory_mb=64, tags=[TAG], client=c)
            return ray.get_runtime_context().get_node_id(), sb.info.node, sb.id

    @ray.remote(num_cpus=0)
    def run_in(sb: corral.Sandbox) -> str:
        return sb.exec("echo from-task", timeout=30).stdout

    for node in corral_cluster.node_ids():
        pinned = NodeAffinitySchedulingStrategy(node, soft=False)
        here, placed, _ = ray.get(make_here.options(scheduling_strategy=pinned).remote(),
                                  timeout=120)
        assert here == node and placed == node
    sb = corral.Sandbox.create(memory_mb=64, tags=[TAG], client=client)
    assert ray.get(run_in.remote(sb), timeout=120) == "from-task\n"


async def test_async_sandbox_and_session(client, corral_cluster):
    before = _free_slots(client)  # (an earlier test's sandboxes may still hold places)
    async with corral.AsyncClient(f"ray://{corral_cluster.address}") as c:
        async with corral.AsyncSession({"memory_mb": 64}, tags=[TAG], client=c) as session:
            made = [await session.create() for _ in range(3)]
            # they fill the nodes to one level from where they were: from an equal start,
            # one on each node
            per_node = Counter(sb.info.node for sb in made)
            left = [before[n] - per_node[n] for n in before]
            assert max(left) - min(left) <= 1, (before, per_node)
            r = await made[1].exec("echo async", timeout=30)
            assert r.stdout == "async\n"
        assert await corral.AsyncSandbox.list(tags=[TAG], client=c) == []


def test_cli_ls_rm_and_info_span_the_cluster(client, corral_cluster, capsys):
    from corral.cli.main import main

    made = [corral.Sandbox.create(memory_mb=64, tags=[TAG], client=client) for _ in range(3)]
    url = ["--url", f"ray://{corral_cluster.address}"]
    assert main(["ls", *url, "--tag", TAG]) == 0
    table = capsys.readouterr().out
    assert "NODE" in table and all(sb.id in table for sb in made)
    assert main(["info", *url, "--json"]) == 0
    info = __import__("json").loads(capsys.readouterr().out)
    assert len(info["nodes"]) == 3 and info["counts"]["running"] >= 3
    assert main(["rm", *url, "--tag", TAG, "-y"]) == 0
    assert "deleted 3 sandboxes" in capsys.readouterr().out
    assert corral.Sandbox.list(tags=[TAG], client=client) == []


def test_bad_addresses_and_ids(client):
    with pytest.raises(corral.DaemonUnavailable, match="ray start --head"):
        corral.Sandbox.list(client=corral.Client("ray://127.0.0.1:1"))
    with pytest.raises(corral.InvalidArgument, match="ray://HOST:PORT"):
        corral.Client("ray://")
    with pytest.raises(corral.SandboxNotFound, match="sb-<node>-<hex>"):
        corral.Sandbox.connect("sb-0123456789ab", client=client)
    with pytest.raises(corral.SandboxLost, match="not alive"):
        corral.Sandbox.connect("sb-ffffffffff-0123456789ab", client=client)


UPPER = "import sys\nfor line in sys.stdin: print(line.upper(), end='', flush=True)"


def test_exchange_all_across_nodes(client, corral_cluster):
    nodes = corral_cluster.node_ids()
    made = [corral.Sandbox.create(memory_mb=64, tags=[TAG], node=n, client=client) for n in nodes]
    procs = [sb.spawn(["python3", "-c", UPPER]) for sb in made]
    lines = corral.Process.exchange_all([(p, f"n{i}\n") for i, p in enumerate(procs)])
    assert lines == [f"N{i}\n" for i in range(len(nodes))]
    assert procs[1].exchange("one\n") == "ONE\n"


def test_snapshots_are_found_on_their_node(client, corral_cluster):
    node = corral_cluster.node_ids()[2]
    sb = corral.Sandbox.create(memory_mb=64, tags=[TAG], node=node, client=client)
    sb.files.write("/tmp/mark", b"from the snapshot")
    name = f"t-cluster-{sb.id[-6:]}"
    snap = sb.snapshot(name=name)
    try:
        assert corral.Snapshot.get(name, client=client).id == snap.id
        assert snap.id in [s.id for s in corral.Snapshot.list(client=client)]
        copy = snap.restore(tags=[TAG])  # placed by room: its layers travel if need be
        assert copy.files.read("/tmp/mark") == b"from the snapshot"
    finally:
        corral.Snapshot.get(name, client=client).delete()
    with pytest.raises(corral.SnapshotNotFound):
        corral.Snapshot.get(name, client=client)


def test_futures_and_a_pool(client, corral_cluster):
    handles = [corral.Sandbox.create_future(memory_mb=64, tags=[TAG], client=client)
               for _ in range(6)]
    made = [h.result(timeout=120) for h in handles]
    assert len({sb.info.node for sb in made}) == 3
    runs = [sb.exec_future("echo f") for sb in made]
    assert [h.result(timeout=60).stdout for h in runs] == ["f\n"] * 6
    node = corral_cluster.node_ids()[1]
    with corral.Pool(memory_mb=64, min_ready=1, max_size=2, node=node, client=client) as pool:
        with pool.acquire(timeout=60) as sb:
            assert sb.info.node == node
            assert sb.exec("echo pooled", timeout=30).stdout == "pooled\n"
        assert pool.stats().max_size == 2  # found on its node
        assert pool.name in [p["name"] for p in client.request("GET", "/v1/pools").json()["pools"]]


TRAINER = """
import sys, time, corral
client = corral.Client(sys.argv[1])
session = corral.Session(lease=float(sys.argv[2]), client=client, tags=[sys.argv[3]])
for node in sys.argv[4:]:
    print(session.create(memory_mb=64, node=node).id, flush=True)
time.sleep(600)
"""


def test_a_lease_spans_the_nodes_and_ends_every_nodes_sandboxes(client, corral_cluster):
    """``Session(lease=S)`` on ``ray://``: renewed on every node that runs one of its
    sandboxes; when the trainer is SIGKILLed, each node ends its own at expiry."""
    import subprocess
    import sys
    import time

    # ttl 10, not less: the trainer's creates and each renewal cross Ray to every node,
    # slow on a loaded host (a node's copy must not expire before its create lands)
    ttl, nodes = 10.0, corral_cluster.node_ids()
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER, f"ray://{corral_cluster.address}", str(ttl), TAG, *nodes],
        stdout=subprocess.PIPE, text=True)
    try:
        ids = [trainer.stdout.readline().strip() for _ in nodes]
        assert all(ids), "the trainer could not create a sandbox on every node"
        made = [corral.Sandbox.connect(i, client=client) for i in ids]
        assert sorted(sb.info.node for sb in made) == sorted(nodes)
        time.sleep(3 * ttl)  # renewals (every ttl/3) must reach every node meanwhile
        assert [sb.refresh().state.value for sb in made] == ["running"] * len(nodes)
    finally:
        trainer.kill()
        trainer.wait()
    deadline = time.monotonic() + 120  # only against a hang: expiry is ttl after the kill
    while time.monotonic() < deadline:
        states = [sb.refresh() for sb in made]
        if all(s.state.value != "running" for s in states):
            break
        time.sleep(0.25)
    for sb in made:
        assert sb.state.value != "running" and "lease expired" in (sb.info.reason or ""), sb.info
