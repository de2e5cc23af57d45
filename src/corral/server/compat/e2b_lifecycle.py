"""E2B's ``lifecycle`` on corral (docs/live.md, "Hibernate"): ``on_timeout="pause"``
(the SDK sends ``autoPause: true``) is corral's ``on_timeout="hibernate"`` on a
checkpointable sandbox; what corral cannot keep is refused, never ignored."""

from __future__ import annotations

from typing import Any

from corral.errors import InvalidArgument
from corral.schema import SandboxSpec


def _refuse(what: str, hint: str) -> InvalidArgument:
    return InvalidArgument(f"{what} is not supported by corral's E2B front-end: {hint}")


def auto_pause(*, pause: bool | None, memory: bool | None, resume: Any,
               networked: bool) -> bool:
    """Whether the sandbox's timeout hibernates it (``autoPause``; ``memory``:
    ``autoPauseMemory``, ``resume``: ``autoResume``; ``networked``: it asked for the
    internet or a network policy, which CRIU cannot dump)."""
    if not pause:
        return False
    if memory is False:
        raise _refuse("lifecycle on_timeout mode='filesystem'", "corral's auto-pause keeps "
                      "the memory too (mode='full', the default)")
    if networked:
        raise _refuse("lifecycle on_timeout='pause' with internet access or a network "
                      "policy", "corral hibernates (checkpoints) only a sandbox without "
                      "network; leave allow_internet_access and network unset, or use "
                      "on_timeout='kill'")
    if isinstance(resume, dict) and resume.get("enabled") is False:
        raise _refuse("lifecycle auto_resume=False", "a corral sandbox paused at its "
                      "timeout resumes on its next command; leave auto_resume unset or True")
    return True


def lifecycle_json(spec: SandboxSpec) -> dict[str, Any]:
    """What ``get_info().lifecycle`` says: a hibernated sandbox resumes on its next
    command (the service layer wakes it), E2B's ``auto_resume``."""
    pauses = spec.on_timeout == "hibernate"
    return {"onTimeout": "pause" if pauses else "kill", "autoResume": pauses}
