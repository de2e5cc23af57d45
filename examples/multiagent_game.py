"""A rock-paper-scissors tournament between agent programs, each in its own sandbox.

Four programs (code strings defining ``act(observation)``) play a round robin: every
pair meets in a match of ``--rounds`` rounds, both agents' moves computed at once in
their own sandboxes, the referee on the host scoring them. Agents remember what they
saw in ``state`` (kept in their sandbox between steps). A match win is worth 3
points, a draw 1. Then all four play one free-for-all match together, which times
the joint step.

    python examples/multiagent_game.py                    # 20 rounds a match
    python examples/multiagent_game.py --rounds 100 --noise 0.1 --seed 3

Without ``--url`` (or ``CORRAL_URL``) the SDK uses the local daemon, starting it if
nothing answers. Every sandbox is deleted when its match ends.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from dataclasses import dataclass

import corral
from corral.rl import MultiAgentSandboxEnv, RockPaperScissors

PROGRAMS = {
    "rocky": """
def act(observation):
    return "rock"
""",
    "cycler": """
MOVES = ["rock", "paper", "scissors"]

def act(observation):
    state["i"] = state.get("i", -1) + 1          # state survives between steps
    return MOVES[state["i"] % 3]
""",
    "beat-last": """
BEATS = {"rock": "paper", "paper": "scissors", "scissors": "rock"}

def act(observation):
    last = observation["last"] or {}
    theirs = [m for agent, m in last.items() if agent != observation["you"] and m]
    return BEATS[theirs[0]] if theirs else "paper"
""",
    "frequency": """
BEATS = {"rock": "paper", "paper": "scissors", "scissors": "rock"}

def act(observation):
    seen = state.setdefault("seen", {})
    for agent, move in (observation["last"] or {}).items():
        if agent != observation["you"] and move:
            seen[move] = seen.get(move, 0) + 1
    if not seen:
        return "scissors"
    return BEATS[max(seen, key=seen.get)]
""",
}


@dataclass
class Standing:
    wins: int = 0
    draws: int = 0
    losses: int = 0
    score: float = 0.0
    faults: int = 0

    @property
    def points(self) -> int:
        return 3 * self.wins + self.draws


def play(agents: list[str], rounds: int, noise: float, seed: int,
         client: corral.Client) -> tuple[dict[str, float], dict[str, int], list[float]]:
    """One match; returns each agent's total reward, faults and the step latencies."""
    programs = {a: PROGRAMS[a] for a in agents}
    game = RockPaperScissors(rounds=rounds, noise=noise)
    totals = dict.fromkeys(agents, 0.0)
    faults = dict.fromkeys(agents, 0)
    latencies = []
    with MultiAgentSandboxEnv(game, programs, client=client, tags=["example=multiagent"]) as env:
        env.reset(seed=seed)
        while env.agents:
            start = time.perf_counter()
            _, rewards, _, _, infos = env.step()
            latencies.append(time.perf_counter() - start)
            for agent, reward in rewards.items():
                totals[agent] += reward
                faults[agent] += infos[agent]["fault"] is not None
    return totals, faults, latencies


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20, help="rounds a match (default 20)")
    parser.add_argument("--noise", type=float, default=0.0,
                        help="chance that a move is swapped at random (default 0)")
    parser.add_argument("--seed", type=int, default=0, help="seed of every match (default 0)")
    parser.add_argument("--url", help="the daemon (default: CORRAL_URL, else the local one)")
    args = parser.parse_args()

    names = list(PROGRAMS)
    table = {name: Standing() for name in names}
    with corral.Client(args.url) as client:
        start = time.perf_counter()
        pairs = list(itertools.combinations(names, 2))
        handles = [corral.submit(play, list(pair), args.rounds, args.noise, args.seed, client)
                   for pair in pairs]
        for (a, b), handle in zip(pairs, handles, strict=True):
            totals, faults, _ = handle.result()
            print(f"match {a:>9} vs {b:<9} {totals[a]:+6.0f} : {totals[b]:+.0f}")
            for me, other in ((a, b), (b, a)):
                row = table[me]
                row.score += totals[me]
                row.faults += faults[me]
                if totals[me] > totals[other]:
                    row.wins += 1
                elif totals[me] == totals[other]:
                    row.draws += 1
                else:
                    row.losses += 1
        elapsed = time.perf_counter() - start
        print(f"{len(pairs)} matches of {args.rounds} rounds in {elapsed:.2f} s\n")

        print(f"{'rank':<5}{'agent':<11}{'W':>3}{'D':>3}{'L':>3}{'points':>8}{'score':>8}"
              f"{'faults':>8}")
        ranked = sorted(names, key=lambda n: (-table[n].points, -table[n].score, n))
        for rank, name in enumerate(ranked, 1):
            row = table[name]
            print(f"{rank:<5}{name:<11}{row.wins:>3}{row.draws:>3}{row.losses:>3}"
                  f"{row.points:>8}{row.score:>+8.0f}{row.faults:>8}")

        totals, _, latencies = play(names, args.rounds, args.noise, args.seed, client)
        ms = sorted(t * 1000 for t in latencies)
        print(f"\nfree-for-all of {len(names)}: "
              + ", ".join(f"{n} {totals[n]:+.0f}" for n in names))
        print(f"joint step with {len(names)} agents: p50 {statistics.median(ms):.1f} ms, "
              f"max {ms[-1]:.1f} ms over {len(ms)} steps")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
