"""Tic-tac-toe against a seeded opponent: a gymnasium-style env in pure Python.

This file imports only the standard library, on purpose: policy evaluation copies it
into a sandbox and runs whole episodes there, in images that have no gymnasium (the
default ``python`` image) as well as in those that do.

    env = TicTacToeEnv(opponent="greedy")
    obs, info = env.reset(seed=7)          # the opponent's choices follow from the seed
    obs, reward, terminated, truncated, info = env.step(4)

- Observation: 9 ints, row by row, from the agent's point of view: ``1`` the agent's
  mark, ``-1`` the opponent's, ``0`` empty (the same whoever moves first).
- Action: a cell ``0..8``. An occupied or out-of-range cell ends the episode with
  ``illegal_move_reward`` (default -1) and ``info["illegal"] = True``.
- Reward, at the end only: ``+1`` win, ``0`` draw, ``-1`` loss.
- Opponents: ``"random"`` (uniform over free cells), ``"greedy"`` (wins if it can,
  blocks if it must, else centre, corner, side, ties broken at random) and
  ``"perfect"`` (minimax: a policy can at best draw). Their randomness comes from
  ``reset(seed=...)``, so a seed fixes the opponent's play.

``RANDOM_POLICY`` and ``GREEDY_POLICY`` are policies as code strings, in the form
:func:`corral.rl.evaluate` takes (a module defining ``act(obs)``).
"""

from __future__ import annotations

import random

LINES = ((0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6))
CENTRE, CORNERS, SIDES = 4, (0, 2, 6, 8), (1, 3, 5, 7)
OPPONENTS = ("random", "greedy", "perfect")
ENV_ID = "corral/TicTacToe-v0"


def winner(board: tuple[int, ...] | list[int]) -> int:
    """``1`` or ``-1`` if that player has three in a row, else ``0``."""
    for a, b, c in LINES:
        if board[a] != 0 and board[a] == board[b] == board[c]:
            return board[a]
    return 0


def legal_actions(board: tuple[int, ...] | list[int]) -> list[int]:
    """The free cells."""
    return [i for i in range(9) if board[i] == 0]


def _completing(board: list[int] | tuple[int, ...], player: int) -> list[int]:
    """Free cells that would give ``player`` three in a row."""
    found = []
    for line in LINES:
        marks = [board[i] for i in line]
        if marks.count(player) == 2 and marks.count(0) == 1:
            found.append(line[marks.index(0)])
    return sorted(set(found))


def greedy_move(board: list[int] | tuple[int, ...], player: int, rng: random.Random) -> int:
    """Win if possible, else block the other side's win, else centre, a corner, a side."""
    for cells in (_completing(board, player), _completing(board, -player)):
        if cells:
            return rng.choice(cells)
    if board[CENTRE] == 0:
        return CENTRE
    for group in (CORNERS, SIDES):
        free = [i for i in group if board[i] == 0]
        if free:
            return rng.choice(free)
    raise ValueError("no legal move: the board is full")


# Positions' values under perfect play (they never change). A dict, not
# ``functools.lru_cache``: importing functools costs an episode's sandbox more CPU than
# the whole game.
_MINIMAX: dict[tuple[tuple[int, ...], int], int] = {}


def _minimax(board: tuple[int, ...], player: int) -> int:
    """The game's value for ``player`` to move (+1 win, 0 draw, -1 loss), perfect play."""
    value = _MINIMAX.get((board, player))
    if value is None:
        value = _MINIMAX[board, player] = _solve(board, player)
    return value


def _solve(board: tuple[int, ...], player: int) -> int:
    w = winner(board)
    if w:
        return w * player
    free = legal_actions(board)
    if not free:
        return 0
    best = -2
    for i in free:
        child = board[:i] + (player,) + board[i + 1:]
        best = max(best, -_minimax(child, -player))
        if best == 1:
            break
    return best


def perfect_move(board: list[int] | tuple[int, ...], player: int, rng: random.Random) -> int:
    """A minimax-optimal move (ties broken at random)."""
    b = tuple(board)
    scored = [(-_minimax(b[:i] + (player,) + b[i + 1:], -player), i) for i in legal_actions(b)]
    best = max(s for s, _ in scored)
    return rng.choice([i for s, i in scored if s == best])


def random_move(board: list[int] | tuple[int, ...], player: int, rng: random.Random) -> int:
    return rng.choice(legal_actions(board))


_MOVES = {"random": random_move, "greedy": greedy_move, "perfect": perfect_move}


class Discrete:
    """``n`` actions, seedable like ``gymnasium.spaces.Discrete`` (which this env must
    not import): ``sample()``, ``seed()``, ``contains()``, ``n``."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._rng = random.Random()

    def seed(self, seed: int | None = None) -> list[int | None]:
        self._rng.seed(seed)
        return [seed]

    def sample(self) -> int:
        return self._rng.randrange(self.n)

    def contains(self, x: object) -> bool:
        return isinstance(x, int) and 0 <= x < self.n

    def __repr__(self) -> str:
        return f"Discrete({self.n})"


class TicTacToeEnv:
    """Tic-tac-toe, the agent against a seeded ``opponent`` (see the module docstring).

    ``agent_first=False`` lets the opponent open (its move is made in ``reset``).
    """

    metadata = {"render_modes": ["ansi"]}

    def __init__(
        self, opponent: str = "random", *, agent_first: bool = True,
        illegal_move_reward: float = -1.0,
    ) -> None:
        if opponent not in _MOVES:
            raise ValueError(f"unknown opponent {opponent!r}: choose one of {', '.join(OPPONENTS)}")
        self.opponent = opponent
        self.agent_first = agent_first
        self.illegal_move_reward = float(illegal_move_reward)
        self.action_space = Discrete(9)
        self._rng = random.Random()
        self._board = [0] * 9
        self._done = True

    def _obs(self) -> list[int]:
        return list(self._board)

    def _info(self, **extra: object) -> dict[str, object]:
        return {"legal_actions": legal_actions(self._board), **extra}

    def reset(
        self, *, seed: int | None = None, options: dict[str, object] | None = None
    ) -> tuple[list[int], dict[str, object]]:
        """A new game; with ``seed``, the opponent's play is fixed by it."""
        if seed is not None:
            self._rng.seed(seed)
        self._board = [0] * 9
        self._done = False
        if not self.agent_first:
            self._board[_MOVES[self.opponent](self._board, -1, self._rng)] = -1
        return self._obs(), self._info()

    def step(self, action: int) -> tuple[list[int], float, bool, bool, dict[str, object]]:
        """Place the agent's mark on ``action``, then the opponent's reply."""
        if self._done:
            raise RuntimeError("the episode has ended: call reset() first")
        try:
            cell = int(action)
        except (TypeError, ValueError):
            cell = -1
        if not 0 <= cell < 9 or self._board[cell] != 0:
            self._done = True
            return self._obs(), self.illegal_move_reward, True, False, self._info(
                illegal=True, winner=-1)
        self._board[cell] = 1
        if winner(self._board) == 1:
            return self._end(1)
        if not legal_actions(self._board):
            return self._end(0)
        self._board[_MOVES[self.opponent](self._board, -1, self._rng)] = -1
        if winner(self._board) == -1:
            return self._end(-1)
        if not legal_actions(self._board):
            return self._end(0)
        return self._obs(), 0.0, False, False, self._info()

    def _end(self, result: int) -> tuple[list[int], float, bool, bool, dict[str, object]]:
        self._done = True
        return self._obs(), float(result), True, False, self._info(winner=result)

    def render(self) -> str:
        marks = {1: "X", -1: "O", 0: "."}
        rows = ["".join(marks[v] for v in self._board[r:r + 3]) for r in (0, 3, 6)]
        return "\n".join(rows)

    def close(self) -> None:
        """Nothing to release (gymnasium API)."""


RANDOM_POLICY = '''\
import random

def act(obs):
    """Any free cell, uniformly (``random`` is seeded per episode by the runner)."""
    return random.choice([i for i, v in enumerate(obs) if v == 0])
'''

GREEDY_POLICY = '''\
import random

from tictactoe import greedy_move

def act(obs):
    """Win if possible, block if needed, else centre, corner, side."""
    return greedy_move(obs, 1, random)
'''
