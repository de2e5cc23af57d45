"""Prometheus metrics of one daemon, at ``GET /metrics`` (admin only on TCP).

Each daemon has its own :class:`~prometheus_client.CollectorRegistry` (never the
process-wide default: tests run many daemons in one process). Two kinds of figures:

- **State, read at scrape time** (:class:`_StateCollector`): sandboxes by state, the
  admission queue and committed memory, ready sandboxes per pool, the snapshot layer
  store, live sandboxes per tenant. Nothing on a request's path keeps them.
- **Events, counted as they happen**: creates (:class:`~corral.server.service.CreateFinished`,
  announced once by the service for every front-end), commands and pool hand-outs
  (:class:`~corral.runtime.events.CommandEnded`, :class:`~corral.runtime.events.PoolAcquired`,
  announced by the engine), sandboxes that ended (:class:`~corral.runtime.events.SandboxEnded`).
  A listener costs an ``observe()`` and an ``inc()``: a few microseconds
  (``benchmarks/bench_metrics.py``).

Label values come from closed sets (states, error codes, outcomes, end reasons)
except pool and tenant names, which clients choose: at most :data:`MAX_LABELLED`
of each get their own series (the oldest pools, the tenants with most sandboxes);
the rest are summed under ``pool="_other"`` / ``tenant="_other"``.

=================================== =========================================================
``corral_sandboxes{state}``         sandboxes the registry holds, by state (gauge)
``corral_sandbox_creates_total``    creates by ``result``: ``ok``, an error code, ``cancelled``
``corral_sandbox_create_seconds``   a successful create, from the call to ready (queueing in)
``corral_sandbox_ends_total``       ended sandboxes by ``reason``: see :func:`end_reason`
``corral_exec_seconds``             a command's run time (histogram)
``corral_exec_results_total``       commands by ``outcome``: ``ok|nonzero|timeout|oom``
``corral_admission_queue_depth``    creates waiting for room (gauge)
``corral_admission_wait_seconds``   from a create's call to its admission (histogram)
``corral_committed_memory_bytes``   memory promised to live and starting sandboxes (gauge)
``corral_pool_ready{pool}``         ready sandboxes per warm pool (a tenant's: ``tenant/name``) (gauge)
``corral_pool_acquire_seconds``     a successful pool acquire's wait (histogram)
``corral_layer_store_bytes``        bytes of committed snapshot layers (gauge)
``corral_tenant_sandboxes{tenant}`` live sandboxes per tenant (gauge)
``corral_output_held_bytes``        commands' and processes' output held (the output budget's use)
``corral_output_budget_bytes``      the output budget (``--output-memory-mb``) (gauge)
``corral_gpus``                     NVIDIA GPUs in the daemon's inventory (gauge)
``corral_gpus_held``                GPUs held by sandboxes, exclusively or shared (gauge)
``corral_build_info{version}``      always 1
=================================== =========================================================
"""

from __future__ import annotations

from collections import Counter as Tally
from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response

from corral._version import __version__
from corral.errors import NotFound
from corral.pool_schema import PoolInfo
from corral.runtime.engine import Engine
from corral.runtime.events import CommandEnded, PoolAcquired, SandboxEnded
from corral.schema import ExecResult, SandboxState
from corral.server.admission import LIVE_STATES
from corral.server.service import CreateFinished, SandboxService
from corral.server.tenants import ADMIN_NAME, require_admin

MAX_LABELLED = 50  # pools (and tenants) with a series of their own; the rest are "_other"
OTHER = "_other"
EXEC_OUTCOMES = ("ok", "nonzero", "timeout", "oom")
END_REASONS = ("deleted", "stopped", "timeout", "idle_timeout", "lease_expired", "failed")
# Seconds: commands run from milliseconds to the 1 h cap; creates take ~10 ms to minutes.
EXEC_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
                30.0, 60.0, 300.0, 1800.0)
CREATE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                  120.0, 300.0)


def exec_outcome(result: ExecResult) -> str:
    """``timeout``, ``oom``, ``ok`` (exit 0) or ``nonzero``."""
    if result.timed_out:
        return "timeout"
    if result.oom_killed:
        return "oom"
    return "ok" if result.returncode == 0 else "nonzero"


def end_reason(event: SandboxEnded) -> str:
    """Why a sandbox ended, from a closed set: ``failed`` (it died, or could not be
    kept), ``timeout`` (its lifetime ran out), ``idle_timeout``, ``lease_expired`` (its
    client died: server/leases.py), ``deleted``, ``stopped``."""
    if event.state == SandboxState.FAILED:
        return "failed"
    if event.reason.startswith("timeout"):
        return "timeout"
    if event.reason.startswith("idle timeout"):
        return "idle_timeout"
    if event.reason.startswith("lease expired"):
        return "lease_expired"
    return "deleted" if event.reason == "deleted" else "stopped"


def bounded(counts: Iterable[tuple[str, float]], limit: int = MAX_LABELLED) -> list[tuple[str, float]]:
    """The first ``limit - 1`` entries as they are and the rest summed under
    :data:`OTHER` (everything as it is if it fits in ``limit``)."""
    items = list(counts)
    if len(items) <= limit:
        return items
    kept = items[: limit - 1]
    return [*kept, (OTHER, sum(value for _, value in items[limit - 1:]))]


class _StateCollector:
    """The gauges, read from the engine, admission control and pools at each scrape."""

    def __init__(self, engine: Engine, service: SandboxService) -> None:
        self.engine = engine
        self.service = service

    def describe(self) -> list[Metric]:
        return []  # collect() is cheap but reads live state: not at registration

    def collect(self) -> Iterator[Metric]:
        counts = self.engine.counts(owner=None)  # the admin's view (metrics_endpoint)
        yield _gauge("corral_sandboxes", "Sandboxes the registry holds, by state.",
                     "state", [(s.value, counts.get(s.value, 0)) for s in SandboxState])
        admission = self.service.admission
        yield GaugeMetricFamily("corral_admission_queue_depth",
                                "Creates waiting in the admission queue.", value=admission.queued)
        yield GaugeMetricFamily(
            "corral_committed_memory_bytes",
            "Memory promised to live and starting sandboxes (their memory_mb).",
            value=admission.committed_memory_mb << 20,
        )
        pools = sorted(self.service.pools.list_pools(owner=None), key=lambda p: (p.created_at, p.name))
        yield _gauge("corral_pool_ready", "Ready sandboxes of each warm pool.", "pool",
                     bounded((_pool_label(p), p.ready) for p in pools))
        registry = self.engine.registry
        layers = registry.layer_rows(sorted(registry.layer_ids()))
        yield GaugeMetricFamily("corral_layer_store_bytes",
                                "Bytes of committed snapshot layers in the state directory.",
                                value=sum(size for _, size in layers.values()))
        tenants = Tally(i.spec.tenant or ADMIN_NAME for i in self.engine.list(state=LIVE_STATES,
                                                                          owner=None))
        yield _gauge("corral_tenant_sandboxes", "Live sandboxes of each tenant.", "tenant",
                     bounded(tenants.most_common()))
        budget = self.engine.output_budget
        yield GaugeMetricFamily("corral_output_held_bytes",
                                "Commands' and processes' output held in memory (reserved).",
                                value=budget.used)
        yield GaugeMetricFamily("corral_output_budget_bytes",
                                "The memory commands' output may take (--output-memory-mb).",
                                value=budget.total)
        gpus = self.engine.gpus
        yield GaugeMetricFamily("corral_gpus", "NVIDIA GPUs in this daemon's inventory.",
                                value=gpus.total)
        yield GaugeMetricFamily("corral_gpus_held",
                                "GPUs held by sandboxes (exclusively or shared).",
                                value=gpus.total - len(gpus.free()))
        yield _gauge("corral_build_info", "The daemon's version.", "version", [(__version__, 1)])


def _pool_label(pool: PoolInfo) -> str:
    """Pool names are per tenant: a tenant's pool is ``tenant/name`` (a pool name
    holds no ``/``), the admin's its name."""
    return pool.name if pool.spec.tenant is None else f"{pool.spec.tenant}/{pool.name}"


def _gauge(name: str, doc: str, label: str, values: Iterable[tuple[str, float]]) -> Metric:
    family = GaugeMetricFamily(name, doc, labels=[label])
    for value_label, value in values:
        family.add_metric([value_label], value)
    return family


class Metrics:
    """One daemon's registry and the listeners that feed it (see the module's table)."""

    def __init__(self, engine: Engine, service: SandboxService) -> None:
        self.registry = registry = CollectorRegistry(auto_describe=False)
        self.creates = Counter("corral_sandbox_creates", "Sandbox creates, by result.",
                               ["result"], registry=registry)
        self.create_seconds = Histogram(
            "corral_sandbox_create_seconds", "A successful create, from the call to ready.",
            buckets=CREATE_BUCKETS, registry=registry)
        self.admission_wait = Histogram(
            "corral_admission_wait_seconds", "From a create's call to its admission.",
            buckets=CREATE_BUCKETS, registry=registry)
        self.ends = Counter("corral_sandbox_ends", "Sandboxes that ended, by reason.",
                            ["reason"], registry=registry)
        self.exec_seconds = Histogram("corral_exec_seconds", "A command's run time.",
                                      buckets=EXEC_BUCKETS, registry=registry)
        self.exec_results = Counter("corral_exec_results", "Commands that ended, by outcome.",
                                    ["outcome"], registry=registry)
        self.pool_acquire = Histogram(
            "corral_pool_acquire_seconds", "A successful warm-pool acquire's wait.",
            buckets=CREATE_BUCKETS, registry=registry)
        # Each series resolved once (labels() costs ~5 us a call), and the ones a
        # dashboard reads exist from the start, at 0.
        self._created = {"ok": self.creates.labels("ok")}
        self._outcomes = {outcome: self.exec_results.labels(outcome) for outcome in EXEC_OUTCOMES}
        self._ends = {reason: self.ends.labels(reason) for reason in END_REASONS}
        registry.register(_StateCollector(engine, service))  # type: ignore[arg-type]
        events = engine.events
        events.subscribe(CreateFinished, self._create_finished)
        events.subscribe(CommandEnded, self._command_ended)
        events.subscribe(SandboxEnded, self._sandbox_ended)
        events.subscribe(PoolAcquired, self._pool_acquired)

    def _create_finished(self, event: CreateFinished) -> None:
        child = self._created.get(event.result)
        if child is None:  # an error code (a closed set) seen for the first time
            child = self._created[event.result] = self.creates.labels(event.result)
        child.inc()
        if event.admitted is not None:
            self.admission_wait.observe(event.admitted - event.began)
        if event.result == "ok":
            self.create_seconds.observe(event.ended - event.began)

    def _command_ended(self, event: CommandEnded) -> None:
        if event.result is None:  # cut short by its caller or its sandbox: no outcome
            return
        self.exec_seconds.observe(event.result.duration)
        self._outcomes[exec_outcome(event.result)].inc()

    def _sandbox_ended(self, event: SandboxEnded) -> None:
        self._ends[end_reason(event)].inc()

    def _pool_acquired(self, event: PoolAcquired) -> None:
        self.pool_acquire.observe(event.seconds)

    def exposition(self) -> bytes:
        """The registry in Prometheus's text format."""
        return generate_latest(self.registry)


async def metrics_endpoint(request: Request) -> Response:
    """``GET /metrics``: Prometheus's text format; the administrator's view of the host."""
    require_admin(request, "GET /metrics")  # the whole host's view
    metrics: Metrics | None = getattr(request.app.state, "metrics", None)
    if metrics is None:
        raise NotFound("this daemon serves no metrics: it was started with --no-metrics")
    return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


def mount(app: Starlette) -> None:
    """Count this daemon's events from now on, for ``GET /metrics`` on ``app``."""
    app.state.metrics = Metrics(app.state.engine, app.state.service)
