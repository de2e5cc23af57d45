"""corral itself, through the blocking SDK and a private daemon: what a user runs.

Timed with the same harness as every peer, so this row compares like with like
(the headline figures come from ``bench_engine.py``, the engine without HTTP). Its
``create_ready`` is ``Sandbox.create`` returning (the agent is ready); the cycle adds
``exec(["true"])`` and ``delete()``.
"""

from __future__ import annotations

import time
from typing import Any

from peers import Peer, Skip

IDLE_MEMORY_MB = 64  # the limit of an idle sandbox (bench_engine's density uses the same)


class CorralSdkPeer(Peer):
    name = "corral"
    title = "corral (SDK → daemon)"

    def check(self) -> None:
        if not self.ctx.corral_url:
            raise Skip("no corral daemon was started for this run")

    def version(self) -> str:
        import corral

        return f"corral {corral.__version__}"

    def setup(self) -> None:
        import corral

        self.corral = corral
        self.client = corral.Client(self.ctx.corral_url)

    def teardown(self) -> None:
        client = getattr(self, "client", None)
        if client is not None:
            client.close()

    def cycle(self) -> float:
        t = time.perf_counter()
        sb = self.corral.Sandbox.create(memory_mb=IDLE_MEMORY_MB, client=self.client)
        ready = (time.perf_counter() - t) * 1e3
        try:
            self.exec_true(sb)
        finally:
            sb.delete()
        return ready

    def start_idle(self) -> Any:
        return self.corral.Sandbox.create(memory_mb=IDLE_MEMORY_MB, client=self.client)

    def exec_true(self, handle: Any) -> None:
        r = handle.exec(["true"])
        if r.returncode != 0:
            raise RuntimeError(f"true exited {r.returncode} in {handle.id}")

    def stop_idle(self, handles: list[Any]) -> None:
        for sb in handles:
            sb.delete()


PEER = CorralSdkPeer
