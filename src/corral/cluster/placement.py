"""Which node a new sandbox goes to: the one with the most room, the caller's own first.

Admission-aware: a node's room is what its daemon's ``GET /v1/info`` reports (live
sandboxes against ``max_sandboxes``, committed memory against ``max_memory_mb``, creates
queued), less the creates this client has sent there since it last asked. A Ray task or
actor (a reward function in a worker) gets a sandbox on its own node while that node
has room; a driver's sandboxes spread over the cluster.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

LIVE = ("pending", "running", "paused")


@dataclass(frozen=True)
class Room:
    """What a node can still take."""

    slots: int  # sandboxes
    memory_mb: int
    fraction: float  # the smaller of the two, as a share of the node's capacity
    queued: int
    gpus: int = 0  # the node's GPUs (its daemon's inventory)
    gpus_free: int = 0  # of which free (a tenant is told only the total: all of them)


def room(info: Mapping[str, Any], *, placed: int = 0, placed_mb: int = 0) -> Room:
    """A node's room from its ``/v1/info``, less ``placed`` sandboxes (``placed_mb``)
    sent there since."""
    cap = info["capacity"]
    live = sum(info["counts"].get(s, 0) for s in LIVE) + placed
    slots = cap["max_sandboxes"] - live
    memory = cap["max_memory_mb"] - info["committed_memory_mb"] - placed_mb
    fraction = min(slots / cap["max_sandboxes"], memory / cap["max_memory_mb"])
    gpus = info.get("gpus") or {}
    total = int(gpus.get("total", 0))
    return Room(slots, memory, fraction, info.get("queued", 0), total,
                int(gpus.get("free", total)))


def has_room(r: Room, memory_mb: int, gpus: int = 0) -> bool:
    """``r`` can take a sandbox of ``memory_mb`` and ``gpus`` (perhaps after its queue):
    when no node can, the cluster is full and the create waits for a node to join."""
    return r.slots >= 1 and r.memory_mb >= memory_mb and r.gpus >= gpus


def choose(rooms: Mapping[str, Room], *, memory_mb: int, local: str | None = None,
           gpus: int = 0) -> str:
    """The node for a sandbox of ``memory_mb``: ``local`` if it has room for it now,
    else the node with the largest share free; if none has room, the shortest queue
    (its daemon queues the create, as one daemon alone would).

    >>> r = {"a": Room(10, 4096, 0.5, 0), "b": Room(18, 8192, 0.9, 0)}
    >>> choose(r, memory_mb=512), choose(r, memory_mb=512, local="a")
    ('b', 'a')
    """
    if gpus:  # only nodes with that many GPUs at all; free ones first (else it queues)
        rooms = {n: r for n, r in rooms.items() if r.gpus >= gpus} or rooms
    if not rooms:
        raise ValueError("no nodes to choose from")

    def fits(r: Room) -> bool:
        return has_room(r, memory_mb, gpus) and r.queued == 0 and r.gpus_free >= gpus

    if local is not None and local in rooms and fits(rooms[local]):
        return local
    fitting = [n for n, r in rooms.items() if fits(r)]
    if fitting:
        return max(fitting, key=lambda n: (rooms[n].fraction, n))
    return min(rooms, key=lambda n: (rooms[n].queued, -rooms[n].fraction, n))


def having_image(rooms: Mapping[str, Room], images: Mapping[str, set[str]], image: str
                 ) -> dict[str, Room]:
    """The nodes of ``rooms`` that have ``image`` (a root filesystem does not travel
    between nodes); all of them if none has it (the chosen node then says ImageNotFound).

    >>> sorted(having_image({"a": Room(1, 1, 1.0, 0), "b": Room(1, 1, 1.0, 0)},
    ...                     {"a": {"python"}, "b": {"python", "mine"}}, "mine"))
    ['b']
    """
    having = {n: r for n, r in rooms.items() if image in images.get(n, ())}
    return having or dict(rooms)
