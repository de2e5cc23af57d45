"""A training run's sandboxes carry its W&B run and Slurm job ids, and the RL toolkit
logs to the open W&B run (issue 25, item 13; CoreWeave's guide does both by hand).

- ``WANDB_RUN_ID`` / ``SLURM_JOB_ID`` tag every sandbox created (``wandb-run:ID``,
  ``slurm-job:ID``), shown by ``corral ls``; ``CORRAL_AUTO_TAGS=0`` opts out.
- ``code_reward`` and ``evaluate`` log their metrics to ``wandb.run`` when one is open,
  tested with W&B's offline mode (skipped if ``wandb`` is not installed).
"""

from __future__ import annotations

import pytest

import corral
from corral.cli.main import main
from corral.client._config import auto_tags
from corral.rl import code_reward, evaluate
from tests.conftest import requires_root

GOOD = "Here:\n```python\ndef f(x):\n    return 2 * x\n```\n"
TESTS = ["assert f(2) == 4"]
OMEGA = "def act(obs):\n    return int(obs[3] > 0)\n"


def test_auto_tags_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("WANDB_RUN_ID", "abc123")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.delenv("CORRAL_AUTO_TAGS", raising=False)
    assert auto_tags() == ["wandb-run:abc123", "slurm-job:4242"]
    monkeypatch.setenv("SLURM_JOB_ID", "not a tag; rm -rf")  # never a malformed tag
    assert auto_tags() == ["wandb-run:abc123"]
    monkeypatch.setenv("CORRAL_AUTO_TAGS", "0")
    assert auto_tags() == []


@requires_root
def test_sandboxes_carry_the_run_and_ls_shows_it(daemon, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_RUN_ID", "run-7f3a")
    monkeypatch.setenv("SLURM_JOB_ID", "991")
    monkeypatch.delenv("CORRAL_AUTO_TAGS", raising=False)
    with corral.Client(daemon.url) as client:
        with corral.Sandbox.create(memory_mb=64, tags=["mine"], client=client) as sb:
            assert sb.tags == ["mine", "wandb-run:run-7f3a", "slurm-job:991"]
            found = corral.Sandbox.list(tags=["wandb-run:run-7f3a"], client=client)
            assert [s.id for s in found] == [sb.id]
            capsys.readouterr()
            assert main(["--url", daemon.url, "ls", "--tag", "slurm-job:991"]) == 0
            listing = capsys.readouterr().out
            assert sb.id in listing and "wandb-run:run-7f3a" in listing
        monkeypatch.setenv("CORRAL_AUTO_TAGS", "0")
        with corral.Sandbox.create(memory_mb=64, client=client) as plain:
            assert plain.tags == []


@pytest.fixture
def wandb_run(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb", reason="wandb is not installed")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = wandb.init(project="corral-test", dir=str(tmp_path))
    try:
        yield run
    finally:
        run.finish()


@requires_root
def test_code_reward_logs_to_the_open_wandb_run(daemon, wandb_run, monkeypatch):
    monkeypatch.setenv("CORRAL_URL", daemon.url)
    reward = code_reward(name="wb")
    got = reward(completions=[GOOD, "no code"], tests=[TESTS, TESTS])
    assert got == [1.0, 0.0], [o.reason for o in reward.last_outcomes]
    wandb_run.log({"train/step_done": 1})  # the trainer commits its step
    summary = dict(wandb_run.summary)
    assert summary["corral/wb/reward_mean"] == 0.5
    assert summary["corral/wb/completions"] == 2
    assert summary["corral/wb/infra_failures"] == 0
    quiet = code_reward(name="quiet", wandb=False)
    quiet(completions=[GOOD], tests=[TESTS])
    wandb_run.log({"train/step_done": 2})
    assert not any(k.startswith("corral/quiet/") for k in dict(wandb_run.summary))


@requires_root
def test_evaluate_logs_its_statistics(daemon, wandb_run, tmp_path):
    with corral.Client(daemon.url) as client:
        result = evaluate(OMEGA, "CartPole-v1", seeds=range(4), concurrency=2, cache=False,
                          client=client, label="omega")
    summary = dict(wandb_run.summary)
    assert summary["corral/eval/omega/mean"] == pytest.approx(result.mean)
    assert summary["corral/eval/omega/episodes"] == 4
    assert summary["corral/eval/omega/ci_low"] == pytest.approx(result.ci[0])


def test_no_open_run_means_no_logging_and_no_import():
    import sys

    from corral.rl._wandb import active_run, log_metrics

    if "wandb" not in sys.modules:
        assert active_run() is None and log_metrics({"x": 1.0}) is False
        assert "wandb" not in sys.modules  # never imported by corral
