"""Tic-tac-toe: evaluate policies given as code strings, then train one with Q-learning
across sandboxes and watch its evaluated return climb.

1. Two policies as code strings (``corral.rl.envs.tictactoe``): random and greedy,
   each evaluated on the same seeds against a random opponent, one sandbox per
   episode. The table shows mean ± 95% CI; the paired difference (same seeds) is
   tighter than either interval.
2. Tabular Q-learning, one sandbox per iteration: the Q-table from the previous
   iteration is uploaded into a fresh sandbox, trained on there for a few thousand
   games, downloaded again; then the greedy policy over it is evaluated (the table
   goes with the policy code as a file, uploaded once per evaluation).

    python examples/tictactoe_eval.py
    python examples/tictactoe_eval.py --iterations 2 --train-episodes 500 --seeds 30
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

import corral
import corral.rl
from corral.rl.envs import tictactoe

TRAINER = '''
import json, os, random, sys
from tictactoe import TicTacToeEnv

episodes, seed = int(sys.argv[1]), int(sys.argv[2])
alpha, gamma, epsilon = 0.3, 0.95, 0.2
q = json.load(open("q.json")) if os.path.exists("q.json") else {}
rng = random.Random(seed)
env = TicTacToeEnv(opponent="random")

def values(state):
    return q.setdefault(state, [0.0] * 9)

wins = draws = losses = 0
for i in range(episodes):
    obs, info = env.reset(seed=seed * 1_000_000 + i)
    done = False
    while not done:
        state, legal = "".join("xo."[v] for v in obs), info["legal_actions"]
        qs = values(state)
        action = rng.choice(legal) if rng.random() < epsilon else max(legal, key=qs.__getitem__)
        obs, reward, done, _, info = env.step(action)
        target = reward
        if not done:
            nxt = values("".join("xo."[v] for v in obs))
            target += gamma * max(nxt[a] for a in info["legal_actions"])
        qs[action] += alpha * (target - qs[action])
    wins += reward > 0
    draws += reward == 0
    losses += reward < 0
json.dump(q, open("q.json", "w"))
print(json.dumps({"episodes": episodes, "wins": wins, "draws": draws, "losses": losses,
                  "states": len(q)}))
'''

Q_POLICY = '''
import json, os, random

Q = json.load(open(os.path.join(os.path.dirname(__file__), "q.json")))

def act(obs):
    legal = [i for i, v in enumerate(obs) if v == 0]
    qs = Q.get("".join("xo."[v] for v in obs))
    if qs is None:
        return random.choice(legal)
    return max(legal, key=qs.__getitem__)
'''


def train_iteration(table: bytes | None, episodes: int, seed: int, client: corral.Client
                    ) -> tuple[bytes, dict]:
    """Upload the table into a fresh sandbox, train there, download the new table."""
    with corral.Sandbox.create(image="python", memory_mb=256, timeout=600, tags=["tictactoe"],
                               client=client) as sb:
        sb.files.write("tictactoe.py", Path(tictactoe.__file__).read_bytes())
        sb.files.write("train.py", TRAINER)
        if table is not None:
            sb.files.write("q.json", table)
        r = sb.exec(["python3", "train.py", str(episodes), str(seed)], timeout=600, check=True)
        return sb.files.read("q.json"), json.loads(r.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=100, help="evaluation seeds (default 100)")
    parser.add_argument("--iterations", type=int, default=4, help="Q-learning iterations")
    parser.add_argument("--train-episodes", type=int, default=3000, help="games per iteration")
    parser.add_argument("--concurrency", type=int, default=8, help="sandboxes at once")
    parser.add_argument("--url", help="the daemon (default: CORRAL_URL, else the local one)")
    args = parser.parse_args()
    # Piped (CI logs, `| tee`): wide enough for the summary table's 13 columns.
    console = Console(width=None if sys.stdout.isatty() else 160)
    # A cache of its own, so every run of the example really runs its episodes.
    cache = Path(tempfile.mkdtemp(prefix="corral-tictactoe-")) / "cache.sqlite"
    common = dict(seeds=range(args.seeds), concurrency=args.concurrency, cache=cache)

    with corral.Client(args.url) as client:
        console.rule("1. policies as code strings, against a random opponent")
        random_r = corral.rl.evaluate(tictactoe.RANDOM_POLICY, "tictactoe", label="random",
                                      client=client, **common)
        greedy_r = corral.rl.evaluate(tictactoe.GREEDY_POLICY, "tictactoe", label="greedy",
                                      client=client, **common)
        table = corral.rl.summary_table([random_r, greedy_r],
                                        title="Tic-tac-toe vs a random opponent")
        console.print(table)
        diff = greedy_r.compare(random_r)
        console.print(f"greedy - random, paired by seed: {diff}")

        console.rule("2. Q-learning: the table travels between sandboxes")
        progress = Table(title="Q-learning iterations (training vs random, then evaluated)")
        for col in ("iteration", "games", "train win rate", "states", "table KB",
                    "eval mean", "95% CI", "train s"):
            progress.add_column(col, justify="right")
        q_table: bytes | None = None
        for it in range(1, args.iterations + 1):
            t = time.perf_counter()
            q_table, stats = train_iteration(q_table, args.train_episodes, it, client)
            train_s = time.perf_counter() - t
            policy = corral.rl.Policy.from_code(Q_POLICY, files={"q.json": q_table},
                                                label=f"q-learning #{it}")
            r = corral.rl.evaluate(policy, "tictactoe", client=client, **common)
            progress.add_row(str(it), str(stats["episodes"] * it),
                             f"{stats['wins'] / stats['episodes']:.0%}", str(stats["states"]),
                             f"{len(q_table) / 1024:.0f}", f"{r.mean:.3f}",
                             f"[{r.ci[0]:.3f}, {r.ci[1]:.3f}]", f"{train_s:.2f}")
            console.print(f"iteration {it}: eval {r.summary} ({r.sandboxes_created} sandboxes)")
        console.print(progress)
        console.print(f"greedy scores {greedy_r.mean:.3f}; the trained table {r.mean:.3f}")
        left = corral.Sandbox.list(tags=["tictactoe"], client=client)
    return 1 if left or random_r.infra_failures or greedy_r.infra_failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
