"""An evaluation reports its progress to the daemon it runs on (``/v1/evals``, shown on
the dashboard), and the report agrees with the result it returns."""

from __future__ import annotations

import asyncio

import pytest

import corral
from corral.errors import InvalidArgument
from corral.rl import evaluate
from corral.rl._eval_report import EvalReporter, histogram

POLICY = "def act(obs):\n    return int(obs[3] > 0)\n"


def test_histogram_bins():
    h = histogram([0.0, 1.0, 2.0, 3.0, 10.0, float("nan")], bins=5)
    assert h == {"low": 0.0, "high": 10.0, "counts": [2, 2, 0, 0, 1]}
    assert histogram([3.0, 3.0]) == {"low": 3.0, "high": 3.0, "counts": [2]}
    assert histogram([]) is None


def test_a_daemon_without_the_endpoint_turns_reporting_off():
    calls = []

    class OldDaemon:
        router = None

        async def call(self, name, ids=None, **kwargs):  # the SDK's call of an operation
            calls.append(name)
            raise corral.errors.NotFound("no route")

    async def main():
        reporter = EvalReporter(OldDaemon(), name="p", env="e")
        await reporter.finish({"state": "done"})
        await reporter.finish({"state": "done"})
        return reporter

    reporter = asyncio.run(main())
    assert len(calls) == 1 and not reporter.enabled


def test_evaluate_reports_its_run(daemon):
    with corral.Client(daemon.url) as client:
        before = {r["id"] for r in client.request("GET", "/v1/evals").json()["evals"]}
        result = evaluate(POLICY, "CartPole-v1", seeds=range(6), client=client, cache=False,
                          label="report-test")
        runs = [r for r in client.request("GET", "/v1/evals").json()["evals"]
                if r["id"] not in before]
        assert len(runs) == 1
        run = runs[0]
        assert (run["name"], run["env"], run["state"]) == ("report-test", "CartPole-v1", "done")
        assert run["done"] == run["total"] == 6 and run["counts"] == {"ok": 6}
        assert run["n"] == 6 and run["mean"] == pytest.approx(result.mean)
        assert (run["ci_low"], run["ci_high"]) == pytest.approx(result.ci)
        assert sum(run["histogram"]["counts"]) == 6
        assert run["histogram"]["low"] == min(e.episode_return for e in result.episodes)

        evaluate(POLICY, "CartPole-v1", seeds=range(2), client=client, cache=False,
                 report=False)
        after = {r["id"] for r in client.request("GET", "/v1/evals").json()["evals"]}
        assert after - before == {run["id"]}  # report=False sent nothing (the list keeps 50)


def test_a_failed_run_is_reported_failed(daemon):
    with corral.Client(daemon.url) as client:
        with pytest.raises(InvalidArgument):  # its check run fails: nothing is evaluated
            evaluate("def act(obs):\n    raise RuntimeError('boom')\n", "CartPole-v1",
                     seeds=range(2), client=client, cache=False, label="report-fails")
        runs = [r for r in client.request("GET", "/v1/evals").json()["evals"]
                if r["name"] == "report-fails"]
        assert runs and runs[0]["state"] == "failed"
        assert "InvalidArgument" in runs[0]["error"] and "boom" in runs[0]["error"]
