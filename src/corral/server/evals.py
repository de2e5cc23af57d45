"""Evaluation runs reported by ``corral.rl.evaluate``, kept for the dashboard.

An evaluation started through :func:`corral.rl.evaluate` against a daemon sends its
progress here (``PUT /v1/evals/{eval_id}``, the whole run's summary each time), and
``GET /v1/evals`` / the dashboard (``/ui``) show the recent ones. Nothing here is
trusted: a report is a bounded pydantic model (names, error text, histogram bins all
capped), the daemon keeps at most :data:`MAX_RUNS` runs, :data:`MAX_RUNS_PER_OWNER` an owner
(past them the oldest of the owner holding the most give way), and a
run belongs to whoever reported it first (:func:`owner_of`): another owner's id
answers 404 like an unknown one.
"""

from __future__ import annotations

import re
import time
from collections import Counter, OrderedDict

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from corral.api.daemon_models import EvalReport, EvalRun
from corral.errors import InvalidArgument, NotFound
from corral.server.tenants import tenant_of

MAX_RUNS = 100  # runs the daemon keeps (all owners together)
MAX_RUNS_PER_OWNER = 50  # so one owner cannot push everyone else's runs out
EVAL_ID_PATTERN = r"^ev-[0-9a-f]{8,32}$"






class EvalStore:
    """The recent runs of one daemon, newest last, bounded (see the module docstring)."""

    def __init__(self, max_runs: int = MAX_RUNS, per_owner: int = MAX_RUNS_PER_OWNER) -> None:
        self.max_runs, self.per_owner = max_runs, per_owner
        self._runs: OrderedDict[str, EvalRun] = OrderedDict()

    def put(self, eval_id: str, report: EvalReport, owner: str | None) -> EvalRun:
        now = time.time()
        old = self._runs.get(eval_id)
        if old is not None and old.owner != owner:
            raise _not_found(eval_id)  # someone else's run: as if unknown
        started = old.started_at if old is not None else now
        run = EvalRun(**report.model_dump(), id=eval_id, owner=owner, started_at=started,
                      updated_at=now)
        self._runs.pop(eval_id, None)
        self._runs[eval_id] = run
        self._evict(owner)
        return run

    def _evict(self, owner: str | None) -> None:
        """Past ``per_owner``, the owner's own oldest go; past ``max_runs``, the oldest
        of the owner holding the most (the reporter itself on a tie): no owner pushes
        another below an equal share."""
        mine = [k for k, r in self._runs.items() if r.owner == owner]
        for key in mine[: max(0, len(mine) - self.per_owner)]:
            del self._runs[key]
        while len(self._runs) > self.max_runs:
            held = Counter(r.owner for r in self._runs.values())
            most = max(held.values())
            biggest = owner if held[owner] == most else next(o for o in held if held[o] == most)
            del self._runs[next(k for k, r in self._runs.items() if r.owner == biggest)]

    def list(self, owner: str | None, *, admin: bool) -> list[EvalRun]:
        """Newest first: all of them for an admin, else the owner's own."""
        runs = [r for r in self._runs.values() if admin or r.owner == owner]
        return runs[::-1]


def _not_found(eval_id: str) -> NotFound:
    return NotFound(f"no evaluation run {eval_id!r}: list them with GET /v1/evals",
                    details={"eval_id": eval_id})


def store(request: Request) -> EvalStore:
    """The daemon's run store (made on first use, one per app)."""
    state = request.app.state
    if not hasattr(state, "evals"):
        state.evals = EvalStore()
    found: EvalStore = state.evals
    return found


def owner_of(request: Request) -> tuple[str | None, bool]:
    """``(owner, is_admin)`` of a request: its caller's tenant (None: the admin, who
    lists every run but owns only its own). A tenant neither reads nor overwrites
    another's runs or the admin's (a forged report would show as theirs)."""
    name = tenant_of(request)
    return name, name is None


async def put_eval(request: Request, body: EvalReport) -> Response:
    eval_id = request.path_params["eval_id"]
    if not re.fullmatch(EVAL_ID_PATTERN, eval_id):
        raise InvalidArgument(
            f"invalid evaluation id {eval_id[:40]!r}: 'ev-' and 8 to 32 hex digits",
            details={"eval_id": eval_id[:40]},
        )
    owner, _ = owner_of(request)
    run = store(request).put(eval_id, body, owner)
    return JSONResponse(run.model_dump(mode="json"))


async def list_evals(request: Request) -> Response:
    owner, admin = owner_of(request)
    runs = store(request).list(owner, admin=admin)
    return JSONResponse({"evals": [r.model_dump(mode="json") for r in runs]})
