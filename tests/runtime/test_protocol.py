"""The protocol's numbers are defined twice, in ``agent/agent.c`` and ``protocol.py``:
they must agree, and neither may give one number two names (a merge of two branches
that each added a message or a field would otherwise pass silently)."""

from __future__ import annotations

import re
from pathlib import Path

import corral.runtime.protocol as protocol
from corral.runtime.protocol import Msg, Tag

AGENT_C = Path(protocol.__file__).parent / "agent" / "agent.c"


def agent_enums() -> dict[str, int]:
    source = AGENT_C.read_text()
    return {
        name: int(value)
        for block in re.findall(r"enum\s*\{([^}]*)\}", source)
        for name, value in re.findall(r"\b([A-Z][A-Z0-9_]*)\s*=\s*(\d+)", block)
    }


def test_agent_and_engine_agree_on_every_number():
    enums = agent_enums()
    in_c = {
        **{("msg", n.split("_", 1)[1]): v for n, v in enums.items() if n.startswith(("M_", "RSP_"))},
        **{("tag", n[2:]): v for n, v in enums.items() if n.startswith("F_")},
    }
    in_py = {**{("msg", m.name): m.value for m in Msg}, **{("tag", t.name): t.value for t in Tag}}
    assert in_c == in_py
    for kind in ("msg", "tag"):
        values = [v for (k, _), v in in_c.items() if k == kind]
        assert len(values) == len(set(values)), f"two {kind} names share a number in agent.c"
