"""Multi-agent environments: one sandbox per agent, a referee on the host.

Each agent is a program, a code string that defines ``act(observation) -> action``,
and runs isolated in its own sandbox: agents cannot read each other's code, share
memory, or touch the host. A joint step asks every agent for its move at the same
time (one ``exec`` per sandbox, concurrently), then the :class:`Game` on the host
(the referee) resolves the joint outcome. The API is PettingZoo's parallel one::

    game = RockPaperScissors(rounds=20)
    with MultiAgentSandboxEnv(game, {"rocky": ROCKY, "copycat": COPYCAT}) as env:
        observations, infos = env.reset(seed=7)
        while env.agents:
            observations, rewards, terminations, truncations, infos = env.step()

``step(actions)`` takes an optional dict: an entry gives that agent a *new program*
(a code string) before it acts, e.g. a policy that writes a new strategy each step;
agents without an entry act with the program they have.

An agent's memory: every step runs its program in a new Python process in its
sandbox, so module-level variables start afresh; a dict ``state`` (a module global,
pickled in the sandbox between steps) and files in the working directory persist
for the whole episode, and so does Python's ``random`` (seeded per agent from the
reset seed, so an episode replays exactly from its seed). ``print`` goes to stderr,
which the infos show for a failed turn.

Failures: an agent that raises, exits, runs past ``act_timeout``, is killed for
memory, or returns an action the game refuses has a *fault* for that step: the
game scores it as the worst move and the env adds ``fault_penalty``; ``infos``
says what happened. A failure of corral itself (the daemon gone, a sandbox lost)
is not a move: it raises the typed :mod:`corral.errors` exception, naming the agent.
``reset`` starts fresh sandboxes (nothing of an episode leaks into the next);
``close`` deletes them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import operator
import random
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from typing_extensions import Self  # typing's since 3.11 only

import corral
from corral._bridge import in_parallel
from corral.client._models import spec_body
from corral.errors import CorralError, InvalidArgument, InvalidState

DEFAULT_ACT_TIMEOUT = 5.0
DEFAULT_FAULT_PENALTY = -1.0
DEFAULT_MEMORY_MB = 128
DEFAULT_SANDBOX_TIMEOUT = 3600.0
AGENT_DIR = "/workspace/.corral"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_ERROR_TAIL = 2000
_EXIT_BAD_ACTION = 3

# Runs in the agent's sandbox for every step: loads the agent's memory, calls act()
# and saves the memory again. Only the runner writes to the real stdout, so an agent
# that prints cannot garble its reply.
RUNNER = r'''
import importlib.util, json, os, pickle, random, sys

HERE = os.path.dirname(os.path.abspath(__file__))
MEMORY = os.path.join(HERE, "memory.pkl")

request = json.loads(sys.stdin.read())
reply = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr
try:
    with open(MEMORY, "rb") as f:
        memory = pickle.load(f)
except FileNotFoundError:
    memory = {"state": {}, "random": None}
if memory["random"] is None:
    random.seed(request["seed"])
else:
    random.setstate(memory["random"])
spec = importlib.util.spec_from_file_location("agent", os.path.join(HERE, "agent.py"))
agent = importlib.util.module_from_spec(spec)
agent.state = memory["state"]
spec.loader.exec_module(agent)
if not callable(getattr(agent, "act", None)):
    sys.exit("the program defines no function act(observation)")
action = agent.act(request["observation"])
try:
    line = json.dumps({"action": action})
except (TypeError, ValueError) as exc:
    print(f"act() returned {type(action).__name__}, not a JSON value: {exc}", file=sys.stderr)
    sys.exit(%d)
with open(MEMORY + ".tmp", "wb") as f:
    pickle.dump({"state": agent.state, "random": random.getstate()}, f)
os.replace(MEMORY + ".tmp", MEMORY)
reply.write(line)
reply.flush()
''' % _EXIT_BAD_ACTION


@dataclasses.dataclass(frozen=True)
class Turn:
    """What one agent did in one joint step.

    ``fault`` is ``None`` for a good move, else ``"crash"`` (raised or exited),
    ``"timeout"``, ``"oom"`` or ``"invalid_action"``; ``error`` then says why (the
    tail of the program's stderr). ``duration`` is the time the program ran, seconds.
    """

    action: Any
    fault: str | None = None
    error: str = ""
    duration: float = 0.0

    def to_info(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Outcome:
    """The referee's verdict on one joint step (every dict is keyed by agent)."""

    observations: dict[str, Any]
    rewards: dict[str, float]
    terminated: bool = False
    truncated: bool = False
    infos: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)


class Game(ABC):
    """The referee: rules, observations and rewards, run on the host.

    Observations must be JSON values (they are sent into the sandboxes).
    """

    name = "game"

    @abstractmethod
    def reset(self, agents: Sequence[str], rng: random.Random) -> dict[str, Any]:
        """Start an episode; the first observation of each agent. ``rng`` is seeded
        from the env's reset seed: draw any randomness of the game from it."""

    @abstractmethod
    def check_action(self, agent: str, action: Any) -> Any:
        """The action if it is legal, else raise :class:`ValueError` saying why."""

    @abstractmethod
    def resolve(self, actions: Mapping[str, Any]) -> Outcome:
        """Resolve one joint step; a faulted agent's action is ``None``."""


class MatrixGame(Game):
    """A repeated simultaneous game, every agent against every other each round.

    ``payoff[(mine, theirs)]`` is what a move earns against one opponent; an agent's
    reward is the sum over its opponents. Against an opponent with a fault an agent
    earns the best payoff, and the faulted one the worst. With ``noise``, each move
    is swapped for another at random with that probability (seeded): the classic
    "trembling hand" that makes forgiving strategies matter.

    Observation: ``{"round", "rounds", "you", "moves", "last": {agent: move or
    None} or None, "scores": {agent: total}}``. The episode ends (truncated) after
    ``rounds`` rounds.
    """

    def __init__(self, name: str, payoff: Mapping[tuple[str, str], float], *,
                 rounds: int = 10, noise: float = 0.0) -> None:
        moves = list(dict.fromkeys(m for pair in payoff for m in pair))
        if {(a, b) for a in moves for b in moves} != set(payoff):
            raise InvalidArgument("payoff needs an entry for every pair of moves")
        if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
            raise InvalidArgument(f"rounds must be a positive integer, got {rounds!r}")
        if not 0.0 <= noise <= 1.0:
            raise InvalidArgument(f"noise must be between 0 and 1, got {noise!r}")
        self.name, self.moves, self.payoff = name, moves, dict(payoff)
        self.rounds, self.noise = rounds, noise
        self._best, self._worst = max(payoff.values()), min(payoff.values())

    def reset(self, agents: Sequence[str], rng: random.Random) -> dict[str, Any]:
        self._agents, self._rng = list(agents), rng
        self._round = 0
        self._scores = dict.fromkeys(agents, 0.0)
        return self._observations(None)

    def _observations(self, last: dict[str, Any] | None) -> dict[str, Any]:
        return {a: {"round": self._round, "rounds": self.rounds, "you": a,
                    "moves": self.moves, "last": last, "scores": dict(self._scores)}
                for a in self._agents}

    def check_action(self, agent: str, action: Any) -> Any:
        if action not in self.moves:
            raise ValueError(f"{action!r} is not a move of {self.name}: one of {self.moves}")
        return action

    def resolve(self, actions: Mapping[str, Any]) -> Outcome:
        played = {}
        for agent in self._agents:  # a fixed order keeps the noise reproducible
            move = actions.get(agent)
            if move is not None and self.noise and self._rng.random() < self.noise:
                move = self._rng.choice([m for m in self.moves if m != move])
            played[agent] = move
        rewards = {}
        for me, mine in played.items():
            total = 0.0
            for other, theirs in played.items():
                if other == me:
                    continue
                if mine is None:
                    total += self._worst
                elif theirs is None:
                    total += self._best
                else:
                    total += self.payoff[(mine, theirs)]
            rewards[me] = total
            self._scores[me] += total
        self._round += 1
        return Outcome(
            observations=self._observations(played), rewards=rewards,
            truncated=self._round >= self.rounds,
            infos={a: {"played": played[a]} for a in self._agents},
        )


def RockPaperScissors(*, rounds: int = 10, noise: float = 0.0) -> MatrixGame:  # noqa: N802
    """Rock-paper-scissors: +1 a win, 0 a draw, -1 a loss, against each opponent."""
    beats = {"rock": "scissors", "paper": "rock", "scissors": "paper"}
    payoff = {(a, b): 0.0 if a == b else (1.0 if beats[a] == b else -1.0)
              for a in beats for b in beats}
    return MatrixGame("rock-paper-scissors", payoff, rounds=rounds, noise=noise)


def PrisonersDilemma(*, rounds: int = 10, noise: float = 0.0) -> MatrixGame:  # noqa: N802
    """The iterated prisoner's dilemma: moves ``cooperate`` and ``defect``, payoffs
    3/3 for mutual cooperation, 1/1 for mutual defection, 5/0 for defecting on a
    cooperator (Axelrod's tournament)."""
    c, d = "cooperate", "defect"
    payoff = {(c, c): 3.0, (c, d): 0.0, (d, c): 5.0, (d, d): 1.0}
    return MatrixGame("prisoners-dilemma", payoff, rounds=rounds, noise=noise)


class MultiAgentSandboxEnv:
    """A parallel multi-agent env whose agents are programs in their own sandboxes.

    ``programs`` maps agent names (1-64 of ``A-Za-z0-9_.-``) to code strings that
    define ``act(observation)``. Sandboxes use ``image`` and ``memory_mb``; each
    turn may run ``act_timeout`` seconds. ``client`` picks the daemon (default: the
    SDK's). Sandboxes live at most ``sandbox_timeout`` seconds, a backstop for a
    process that dies without :meth:`close`. See the module doc for the step
    protocol, memory and faults; an infrastructure error in :meth:`step` ends the
    episode (``reset`` to go on).
    """

    metadata = {"name": "corral_multiagent_v0", "is_parallelizable": True}

    def __init__(
        self,
        game: Game,
        programs: Mapping[str, str],
        *,
        image: str = "python",
        memory_mb: int = DEFAULT_MEMORY_MB,
        act_timeout: float = DEFAULT_ACT_TIMEOUT,
        fault_penalty: float = DEFAULT_FAULT_PENALTY,
        sandbox_timeout: float = DEFAULT_SANDBOX_TIMEOUT,
        tags: Sequence[str] = (),
        client: corral.Client | None = None,
    ) -> None:
        if not isinstance(game, Game):
            raise InvalidArgument(f"game must be a corral.rl Game, got {type(game).__name__}")
        if not programs:
            raise InvalidArgument("programs must name at least one agent")
        for name, code in programs.items():
            _check_program(name, code)
        if not act_timeout > 0:
            raise InvalidArgument(f"act_timeout must be positive, got {act_timeout!r}")
        self.game = game
        self.possible_agents: list[str] = list(programs)
        self.agents: list[str] = []
        self.act_timeout = float(act_timeout)
        self.fault_penalty = float(fault_penalty)
        self._programs = dict(programs)
        # The lifetime is a backstop for a process that dies without close().
        self._defaults = {"image": image, "memory_mb": memory_mb, "timeout": sandbox_timeout}
        self._tags = [*tags, "corral-env=multiagent"]
        spec_body({**self._defaults, "tags": self._tags})  # bad limits fail here, not in reset
        self._client = client
        self._session: corral.Session | None = None
        self._sandboxes: dict[str, corral.Sandbox] = {}
        self._seeds: dict[str, int] = {}
        self._observations: dict[str, Any] = {}
        self._closed = False

    # ------------------------------------------------------------- queries

    def program(self, agent: str) -> str:
        """The code an agent runs now."""
        return self._programs[self._known(agent)]

    def sandbox(self, agent: str) -> corral.Sandbox:
        """The sandbox of an agent in the current episode (e.g. to look at its files)."""
        if self._known(agent) not in self._sandboxes:
            raise InvalidState("no episode is running: call reset() first")
        return self._sandboxes[agent]

    def _known(self, agent: str) -> str:
        if agent not in self._programs:
            raise InvalidArgument(f"no agent {agent!r}: the agents are {self.possible_agents}")
        return agent

    # ------------------------------------------------------------ episodes

    def reset(self, *, seed: int | None = None,
              options: Mapping[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        """Start an episode in fresh sandboxes; returns ``(observations, infos)``.

        The same ``seed`` replays the same episode (the game's randomness and each
        agent's ``random``); without one a seed is drawn and reported in ``infos``.
        ``options={"programs": {agent: code}}`` replaces programs from now on.
        """
        if self._closed:
            raise InvalidState("the env is closed: make a new one")
        programs = dict((options or {}).get("programs") or {})
        for name, code in programs.items():
            _check_program(self._known(name), code)
        self._programs.update(programs)
        if seed is None:
            seed = random.SystemRandom().getrandbits(63)
        try:
            seed = operator.index(seed)
        except TypeError:
            raise InvalidArgument(f"seed must be an integer or None, got {seed!r}") from None
        rng = random.Random(seed)
        self._seeds = {a: rng.getrandbits(63) for a in self.possible_agents}
        game_rng = random.Random(rng.getrandbits(63))
        self._end_session()
        self._session = corral.Session(
            defaults=self._defaults, tags=self._tags,
            client=self._client,
        )
        results = self._fan_out(self._start_agent, self.possible_agents)
        failed = [r for r in results.values() if isinstance(r, BaseException)]
        if failed:
            self._end_session()
            raise failed[0]
        self._sandboxes = results
        self.agents = list(self.possible_agents)
        self._observations = self.game.reset(list(self.agents), game_rng)
        infos = {a: {"seed": seed, "sandbox_id": self._sandboxes[a].id} for a in self.agents}
        return dict(self._observations), infos

    def _start_agent(self, agent: str) -> corral.Sandbox:
        assert self._session is not None
        try:
            sb = self._session.create(tags=[f"agent={agent}"])
            sb.files.write(f"{AGENT_DIR}/runner.py", RUNNER)
            sb.files.write(f"{AGENT_DIR}/agent.py", self._programs[agent])
        except CorralError as exc:
            raise _blame(exc, agent) from exc
        return sb

    def step(self, actions: Mapping[str, str | None] | None = None) -> tuple[
        dict[str, Any], dict[str, float], dict[str, bool], dict[str, bool], dict[str, Any]
    ]:
        """One joint step: every live agent acts in its sandbox, concurrently, then
        the game resolves. ``actions[agent]``, if given and not ``None``, is a new
        program for that agent (its memory is kept). Returns PettingZoo's
        ``(observations, rewards, terminations, truncations, infos)``."""
        if not self.agents:
            raise InvalidState("no episode is running: call reset() (the last one ended)")
        for agent, code in (actions or {}).items():
            if agent not in self.agents:
                raise InvalidArgument(f"{agent!r} is not a live agent: {self.agents}")
            if code is not None:
                _check_program(agent, code)
        new = {a: c for a, c in (actions or {}).items() if c is not None}
        turns = self._fan_out(lambda a: self._turn(a, new.get(a)), self.agents)
        errors = [t for t in turns.values() if isinstance(t, BaseException)]
        if errors:
            self.agents = []  # the agents' memories moved on unevenly: start over
            raise errors[0]
        self._programs.update(new)
        outcome = self.game.resolve({a: t.action for a, t in turns.items()})
        rewards, infos = {}, {}
        for agent in self.agents:
            reward = float(outcome.rewards.get(agent, 0.0))
            if turns[agent].fault is not None:
                reward += self.fault_penalty
            rewards[agent] = reward
            infos[agent] = {**outcome.infos.get(agent, {}), **turns[agent].to_info()}
        terminations = dict.fromkeys(self.agents, outcome.terminated)
        truncations = dict.fromkeys(self.agents, outcome.truncated and not outcome.terminated)
        observations = {a: outcome.observations[a] for a in self.agents}
        self._observations = observations
        if outcome.terminated or outcome.truncated:
            self.agents = []
        return observations, rewards, terminations, truncations, infos

    def _turn(self, agent: str, new_program: str | None) -> Turn:
        sb = self._sandboxes[agent]
        request = json.dumps({"observation": self._observations[agent],
                              "seed": self._seeds[agent]})
        try:
            if new_program is not None:
                sb.files.write(f"{AGENT_DIR}/agent.py", new_program)
            r = sb.exec(["python3", f"{AGENT_DIR}/runner.py"], stdin=request,
                        timeout=self.act_timeout, max_output=64 * 1024)
        except CorralError as exc:
            raise _blame(exc, agent) from exc
        error = r.stderr[-_ERROR_TAIL:]
        if r.timed_out:
            return Turn(None, "timeout", f"no move within {self.act_timeout}s", r.duration)
        if r.oom_killed:
            return Turn(None, "oom", "killed: over the sandbox's memory limit", r.duration)
        if r.returncode == _EXIT_BAD_ACTION:
            return Turn(None, "invalid_action", error, r.duration)
        if r.returncode != 0:
            return Turn(None, "crash", error or f"exit status {r.returncode}", r.duration)
        try:  # the reply is the agent's to forge: anything but {"action": ...} is a crash
            action = json.loads(r.stdout)["action"]
        except (ValueError, KeyError, TypeError, RecursionError):
            return Turn(None, "crash", f"no reply from act(): {r.stdout[:200]!r}", r.duration)
        try:
            action = self.game.check_action(agent, action)
        except (ValueError, TypeError) as exc:
            return Turn(None, "invalid_action", str(exc), r.duration)
        return Turn(action, None, "", r.duration)

    def _fan_out(self, fn: Callable[[str], Any], agents: Sequence[str]) -> dict[str, Any]:
        """``fn(agent)`` for every agent at once: each result, or the exception raised.

        Not bounded by ``CORRAL_MAX_WORKERS``: an env used inside ``corral.submit`` (a
        tournament running matches side by side) would otherwise wait for threads its
        own callers hold.
        """
        outcomes = in_parallel([functools.partial(fn, a) for a in agents], limit=max(1, len(agents)))
        return dict(zip(agents, outcomes, strict=True))

    def _end_session(self) -> None:
        session, self._session = self._session, None
        self._sandboxes = {}
        self.agents = []
        if session is not None:
            session.close()

    def close(self) -> None:
        """Delete every sandbox of the env; closing twice is fine."""
        self._closed = True
        self._end_session()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"<MultiAgentSandboxEnv {self.game.name} agents={self.possible_agents} "
                f"live={len(self.agents)}>")


def _check_program(name: Any, code: Any) -> None:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise InvalidArgument(
            f"agent name {name!r}: use 1-64 letters, digits or _.- (starting with a letter "
            "or digit)"
        )
    if not isinstance(code, str) or not code.strip():
        raise InvalidArgument(f"agent {name!r}: the program must be a non-empty code string")


def _blame(exc: CorralError, agent: str) -> CorralError:
    """The same typed error, saying which agent's sandbox it hit."""
    return type(exc)(f"agent {agent!r}: {exc.message}", details={**exc.details, "agent": agent})


__all__: list[str] = [
    "Game", "MatrixGame", "MultiAgentSandboxEnv", "Outcome", "PrisonersDilemma",
    "RockPaperScissors", "Turn",
]
