"""corral.rl"""

# Names from modules with heavier imports (numpy; pyarrow only when Parquet is used),
# loaded on first access so that `import corral.rl` stays cheap.
_LAZY = {
    "ExperienceBuffer": "corral.rl.buffer",
    "ExperienceWriter": "corral.rl.buffer",
    "Transitions": "corral.rl.buffer",
    "Game": "corral.rl.envs.multiagent",
    "MatrixGame": "corral.rl.envs.multiagent",
    "MultiAgentSandboxEnv": "corral.rl.envs.multiagent",
    "Outcome": "corral.rl.envs.multiagent",
    "PrisonersDilemma": "corral.rl.envs.multiagent",
    "RockPaperScissors": "corral.rl.envs.multiagent",
    "Turn": "corral.rl.envs.multiagent",
    "EnvError": "corral.rl.gym_env",
    "Episode": "corral.rl.branching",
    "branch_seeds": "corral.rl.branching",
    "SandboxEnv": "corral.rl.gym_env",
    "SandboxVectorEnv": "corral.rl.vector",
    "ReproReport": "corral.rl.reproducibility",
    "SeedResult": "corral.rl.reproducibility",
    "trajectory_digest": "corral.rl.reproducibility",
    "verify_reproducible": "corral.rl.reproducibility",
    "AsyncCodeReward": "corral.rl.rewards",
    "CodeReward": "corral.rl.rewards",
    "RewardOutcome": "corral.rl.rewards",
    "async_code_reward": "corral.rl.rewards",
    "code_reward": "corral.rl.rewards",
    "TestReport": "corral.rl.code",
    "extract_code": "corral.rl.code",
    "IOCase": "corral.rl.stdio",
    "arun_io_tests": "corral.rl.stdio",
    "extract_program": "corral.rl.stdio",
    "run_io_tests": "corral.rl.stdio",
    "CodeTask": "corral.rl.datasets",
    "load_tasks": "corral.rl.datasets",
    "SandboxToolEnv": "corral.rl.trl_env",
    "CodegenEnv": "corral.rl.envs.codegen",
    "Problem": "corral.rl.envs.codegen",
    "INFRA_ERRORS": "corral.rl.episodes",
    "EpisodeError": "corral.rl.episodes",
    "EpisodeProgress": "corral.rl._progress",
    "EpisodeResult": "corral.rl.episodes",
    "EpisodeRunner": "corral.rl.episodes",
    "EpisodeStatus": "corral.rl.episodes",
    "EpisodeTimeout": "corral.rl.episodes",
    "ScriptEpisode": "corral.rl.episodes",
    "arun_episodes": "corral.rl.episodes",
    "is_infrastructure_error": "corral.rl.episodes",
    "parse_json_line": "corral.rl.episodes",
    "run_episodes": "corral.rl.episodes",
    "EnvSpec": "corral.rl._policy",
    "Policy": "corral.rl._policy",
    "EpisodeErrors": "corral.rl.evaluation",
    "EvalEpisode": "corral.rl.evaluation",
    "EvalOptions": "corral.rl._eval_options",
    "EvalResult": "corral.rl.evaluation",
    "aevaluate": "corral.rl.evaluation",
    "evaluate": "corral.rl.evaluation",
    "parse_seeds": "corral.rl.evaluation",
    "Summary": "corral.rl.stats",
    "paired_difference": "corral.rl.stats",
    "summarize": "corral.rl.stats",
    "t_quantile": "corral.rl.stats",
    "TicTacToeEnv": "corral.rl.envs.tictactoe",
    "register_envs": "corral.rl._gym_registration",
    "KernelOutcome": "corral.rl.kernel",
    "kernel_reward": "corral.rl.kernel",
    "plot_returns": "corral.rl._report",
    "summary_table": "corral.rl._report",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'corral.rl' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


# gym.make("corral/SandboxEnv-v0", ...): registered now if gymnasium is imported, else
# as soon as it is (without importing it here).
from corral.rl._gym_registration import register_on_import as _register_on_import  # noqa: E402

_register_on_import()
