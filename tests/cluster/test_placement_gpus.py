"""Placement by GPUs on a cluster: a GPU sandbox goes to a node with that many GPUs,
a free one first; a node's GPUs come from its daemon's /v1/info. Ray's autoscaler is
shown GPU sandboxes, live or waiting, as bundles with Ray's ``GPU`` resource (what
``num_gpus`` asks for), so it adds GPU nodes for them; read back from a real GCS in
tests/cluster/test_autoscale.py."""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

from corral.cluster import autoscale
from corral.cluster.placement import Room, choose, has_room, room
from corral.runtime.gpus import GpuAllocator, GpuDevice, StaticBackend


def _info(gpus: dict | None, live: int = 0) -> dict:
    return {"capacity": {"max_sandboxes": 10, "max_memory_mb": 10_000},
            "counts": {"running": live}, "committed_memory_mb": 0, "queued": 0,
            **({"gpus": gpus} if gpus is not None else {})}


def test_a_nodes_gpus_come_from_its_info():
    assert room(_info({"total": 4, "free": 1})).gpus_free == 1
    assert room(_info({"total": 4})).gpus_free == 4  # a tenant sees the total only
    assert room(_info(None)).gpus == 0  # a daemon from before GPUs


def test_a_gpu_sandbox_goes_where_gpus_are_free():
    rooms = {"cpu": room(_info(None)), "busy": room(_info({"total": 2, "free": 0})),
             "free": room(_info({"total": 2, "free": 2}, live=5))}
    assert choose(rooms, memory_mb=512) == "cpu"  # most room: a CPU sandbox
    assert choose(rooms, memory_mb=512, gpus=1) == "free"
    assert choose(rooms, memory_mb=512, gpus=1, local="cpu") == "free"  # never a CPU node
    assert choose(rooms, memory_mb=512, gpus=2, local="busy") == "free"
    # every GPU node busy: the one with GPUs at all, where the daemon queues it
    rooms["free"] = Room(5, 10_000, 0.5, 0, 2, 0)
    assert choose(rooms, memory_mb=512, gpus=1) in {"busy", "free"}
    assert not has_room(rooms["cpu"], 512, gpus=1) and has_room(rooms["busy"], 512, gpus=2)


def _entry(sandboxes, gpus=None, at=None) -> bytes:
    return json.dumps({"sandboxes": sandboxes, "memory_mb": 64 * sandboxes,
                       "at": time.time() if at is None else at,
                       **({"gpus": gpus} if gpus is not None else {})}).encode()


def test_gpu_sandboxes_are_shown_to_the_autoscaler_with_their_gpus():
    now = time.time()
    # a client waits with three creates: one asks for two GPUs, one for one
    waiting = autoscale.entry_shapes(_entry(3, {"2": 1, "1": 1}), now)
    assert waiting == Counter({0.0: 1, 1.0: 1, 2.0: 1})
    assert autoscale.entry_shapes(_entry(2), now) == Counter({0.0: 2})  # a client before GPUs
    assert autoscale.entry_shapes(_entry(2, at=now - autoscale.DEMAND_TTL_S - 1), now) is None
    # a node's live sandboxes: 4, of which one holds two GPUs and two share one
    info = {"counts": {"running": 3, "pending": 1, "deleted": 9},
            "gpus": {"total": 4, "free": 1, "holding": {"2": 1, "0.5": 2}}}
    live = autoscale.live_shapes(info, ("running", "pending", "paused"))
    assert live == Counter({0.0: 1, 0.5: 2, 2.0: 1})
    assert autoscale.bundles(live + waiting) == [
        {"corral_sandbox": 1.0}, {"corral_sandbox": 1.0}, {"corral_sandbox": 1.0, "GPU": 0.5},
        {"corral_sandbox": 1.0, "GPU": 0.5}, {"corral_sandbox": 1.0, "GPU": 1.0},
        {"corral_sandbox": 1.0, "GPU": 2.0}, {"corral_sandbox": 1.0, "GPU": 2.0}]
    assert autoscale.bundles(2, "mine") == [{"mine": 1.0}] * 2
    # what a daemon holds: exclusive GPUs whole, a shared one split between its sharers
    alloc = GpuAllocator(StaticBackend([GpuDevice(i, f"GPU-{i}", "H200", i, 141_000,
                                                  Path(f"/dev/nvidia{i}")) for i in range(4)]))
    alloc.assign("sb-two", 2)
    alloc.assign("sb-a", ["2"], shared=True)
    alloc.assign("sb-b", ["2"], shared=True)
    assert alloc.holding() == {"2": 1, "0.5": 2}
    assert autoscale.live_shapes({"counts": {"running": 3}, "gpus": {"total": 4}},
                                 ("running",)) == Counter({0.0: 3})  # a tenant's view


def test_wild_gpu_demand_is_dropped_or_capped():
    """Every Ray member can write a demand entry: its GPUs never count for more
    sandboxes than it waits with, nor for amounts no sandbox could hold."""
    now = time.time()
    for gpus in ([1], "2", {"x": 1}, {"nan": 1}, {"inf": 1}, {"-1": 1}, {"0": 5},
                 {"1": -3}, {"1": "many"}, {str(autoscale.MAX_GPUS + 1): 1}):
        assert autoscale.entry_shapes(_entry(2, gpus), now) == Counter({0.0: 2}), gpus
    assert autoscale.entry_shapes(_entry(2, {"1": 10**9}), now) == Counter({1.0: 2})
    # shares are shown to four places, more than one GPU as a whole number (Ray's rules)
    assert autoscale.entry_shapes(_entry(3, {"0.333333": 1, "1.5": 1, "1e-9": 1}), now
                                  ) == Counter({0.3333: 1, 2.0: 1, 0.0001: 1})


def test_a_gpu_create_that_found_no_room_says_how_to_get_a_gpu_node():
    err = autoscale.no_room("10.0.0.5:6379", 512, 120.0, gpus=2)
    message = str(err)
    assert "'GPU': 2" in message and "GPUs" in message and "CORRAL_PLACEMENT_WAIT" in message
    assert err.details["gpus"] == 2
    assert "GPU" not in str(autoscale.no_room("10.0.0.5:6379", 512, 120.0))
