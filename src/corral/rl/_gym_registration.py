"""corral's environments in gymnasium's registry: ``gym.make("corral/SandboxEnv-v0")``.

::

    import corral.rl
    import gymnasium as gym

    env = gym.make("corral/SandboxEnv-v0", env_id="CartPole-v1")       # one sandbox
    envs = gym.make_vec("corral/SandboxEnv-v0", num_envs=8, env_id="CartPole-v1")

``corral/SandboxEnv-v0`` makes a :class:`~corral.rl.SandboxEnv` (its keyword arguments:
``env_id``, ``image``, ``sandbox_options``, the env's own...); ``make_vec`` makes a
:class:`~corral.rl.SandboxVectorEnv` (``vector_entry_point``: every sub-environment
steps in its own sandbox, all at once), or with ``vectorization_mode="sync"`` /
``"async"`` gymnasium's own vector env over single ones. No ``max_episode_steps``:
the environment in the sandbox has its own time limit (CartPole-v1's 500 steps).

gymnasium 1.4 loads no plugins, so registering is corral's job: ``import corral.rl``
registers them if gymnasium is imported, or else the moment it is (a one-shot import
hook; ``import corral.rl`` itself never imports gymnasium, which costs a third of a
second). :func:`register_envs` does it explicitly, and gymnasium's own
``gym.make("corral.rl:corral/SandboxEnv-v0", ...)`` imports ``corral.rl`` first.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from typing import Any

SANDBOX_ENV_ID = "corral/SandboxEnv-v0"
ENV_IDS = (SANDBOX_ENV_ID,)


def register_envs() -> None:
    """Add corral's environments to gymnasium's registry (idempotent)."""
    from gymnasium.envs.registration import register, registry

    if SANDBOX_ENV_ID not in registry:
        register(
            id=SANDBOX_ENV_ID,
            entry_point="corral.rl.gym_env:SandboxEnv",
            vector_entry_point="corral.rl.vector:SandboxVectorEnv",
        )


class _RegisterWhenImported(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when ``gymnasium`` is first imported, it has the real
    loader run and then registers corral's environments."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != "gymnasium":
            return None
        _remove_hook()
        spec = importlib.util.find_spec(fullname)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_and_register(module: Any) -> None:
            exec_module(module)
            try:
                register_envs()
            except Exception:  # never break the user's import of gymnasium
                pass

        loader.exec_module = exec_and_register
        return spec


_HOOK = _RegisterWhenImported()


def _remove_hook() -> None:
    if _HOOK in sys.meta_path:
        sys.meta_path.remove(_HOOK)


def register_on_import() -> None:
    """Register now if gymnasium is imported, else when it is."""
    if "gymnasium.envs.registration" in sys.modules:
        register_envs()
    elif "gymnasium" not in sys.modules and _HOOK not in sys.meta_path:
        sys.meta_path.insert(0, _HOOK)
