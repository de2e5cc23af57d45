"""Placement by GPUs on a cluster: a GPU sandbox goes to a node with that many GPUs,
a free one first; a node's GPUs come from its daemon's /v1/info."""

from __future__ import annotations

from corral.cluster.placement import Room, choose, has_room, room


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
