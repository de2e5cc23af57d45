"""``corral eval POLICY_FILE``: evaluate a policy over seeded episodes, each in a sandbox.

    corral eval policy.py --env CartPole-v1 --seeds 0-99
    corral eval weights.npy --env CartPole-v1 --adaptive --target-halfwidth 5 --budget 2000
    corral eval greedy.py --env tictactoe --env-arg opponent=perfect --png returns.png
    corral eval policy.py --json > result.json

A live progress bar (running mean ± CI) goes to stderr when it is a terminal; the
summary table (or --json) goes to stdout. Finished episodes are cached, so running
the same command again costs no sandbox, once a re-run episode showed the policy
deterministic (a policy drawing os.urandom is run every time); --no-cache skips it.

Episodes the policy failed (raised or timed out): by default no mean is printed and
the exit status is 1; --on-error zero (or a return, e.g. -1) scores them, --on-error
exclude leaves them out, and the table says which. The interval (CI method column)
is the bootstrap (BCa) when returns are bounded (--bounds, or a known env such as
CartPole-v1), else Student's t; --ci-method chooses. Exit status 1 also if episodes
failed for infrastructure reasons (never scored: run again to fill them in).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from corral.cli._output import Context, UsageError


def _env_arg(text: str) -> tuple[str, Any]:
    """``K=V``; V is read as JSON when it parses (``3``, ``true``), else kept as text."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    try:
        return name, json.loads(value)
    except ValueError:
        return name, value


def _on_error(text: str) -> str | float:
    if text in ("raise", "exclude", "zero"):
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected raise, exclude, zero or a number, got {text!r}") from None


def _bounds(text: str) -> tuple[float, float]:
    lo, sep, hi = text.partition(",")
    try:
        return float(lo), float(hi)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO,HI (e.g. 0,500), got {text!r}") from None


def add_parser(sub: Any, conn: list[argparse.ArgumentParser]) -> None:
    """Register ``corral eval`` on the main parser's subcommands."""
    p = sub.add_parser(
        "eval", parents=conn, help="evaluate a policy: seeded episodes in sandboxes, mean ± CI",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("policy", metavar="POLICY_FILE",
                   help="a .py module defining act(obs), or weights (.npy, .json, .pt)")
    p.add_argument("--env", default="CartPole-v1",
                   help="a gymnasium id (image rl) or tictactoe (image python); default CartPole-v1")
    p.add_argument("--env-arg", type=_env_arg, action="append", default=[], metavar="K=V",
                   help="an env keyword argument (repeatable; V parsed as JSON if it can be)")
    p.add_argument("--image", help="run in this image instead of the env's default")
    p.add_argument("--max-steps", type=int, metavar="N", help="truncate episodes after N steps")
    p.add_argument("--seeds", metavar="SPEC",
                   help="e.g. 0-99 or 1,5,9 (default 0-99; adaptive: 0, 1, 2, ... until done)")
    p.add_argument("--episodes-per-seed", type=int, default=1, metavar="N")
    p.add_argument("--episodes-per-sandbox", type=int, default=1, metavar="N",
                   help="episodes run one after another in one sandbox (default 1: each its own)")
    p.add_argument("--concurrency", type=int, default=8, metavar="N", help="sandboxes at once")
    p.add_argument("--timeout", type=float, default=60.0, metavar="S", help="seconds per episode")
    p.add_argument("--retries", type=int, default=2, metavar="N",
                   help="retries of infrastructure failures (a policy's own failure is never retried)")
    p.add_argument("--memory-mb", type=int, metavar="MB", help="sandbox memory (default 512)")
    p.add_argument("--adaptive", action="store_true",
                   help="add episodes in batches until the CI half-width reaches --target-halfwidth")
    p.add_argument("--target-halfwidth", type=float, metavar="X")
    p.add_argument("--budget", type=int, metavar="N", help="adaptive: at most N episodes")
    p.add_argument("--budget-seconds", type=float, metavar="S", help="adaptive: stop after S seconds")
    p.add_argument("--batch-size", type=int, metavar="N", help="adaptive: episodes per batch")
    p.add_argument("--confidence", type=float, default=0.95, metavar="C")
    p.add_argument("--on-error", type=_on_error, default=None, metavar="HOW",
                   help="episodes the policy failed: raise (default: no mean, exit 1), zero, "
                        "a return R to score them as, or exclude (leave them out)")
    p.add_argument("--error-return", type=float, metavar="R", help="the same as --on-error R")
    p.add_argument("--ci-method", choices=("t", "bootstrap"),
                   help="the interval: bootstrap (BCa, seeded) or Student's t (default: "
                        "bootstrap if the return's range is known, else t)")
    p.add_argument("--bounds", type=_bounds, metavar="LO,HI",
                   help="the range returns can take (the interval stays inside it)")
    p.add_argument("--cache", metavar="PATH", help="the cache file (default: the user's cache dir)")
    p.add_argument("--no-cache", action="store_true",
                   help="neither read nor write the cache (every episode runs)")
    p.add_argument("--png", metavar="OUT.png", help="draw the return distribution")
    p.add_argument("--per-seed", action="store_true", help="also print a table per seed")
    p.add_argument("--json", action="store_true", help="print the whole result as JSON")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace, ctx: Context) -> int:
    from corral.rl._progress import EpisodeProgress
    from corral.rl.evaluation import evaluate

    if args.adaptive and args.target_halfwidth is None:
        raise UsageError("--adaptive needs --target-halfwidth")
    if not args.adaptive and (args.budget or args.budget_seconds or args.batch_size
                              or args.target_halfwidth):
        raise UsageError("--target-halfwidth, --budget, --budget-seconds and --batch-size "
                         "go with --adaptive")
    if args.no_cache and args.cache:
        raise UsageError("--cache and --no-cache contradict each other")
    out = ctx.output
    sandbox = {"memory_mb": args.memory_mb} if args.memory_mb else None
    bar = EpisodeProgress(args.budget, label=f"{args.policy} on {args.env}", console=out.err,
                          enabled=out.err.is_terminal)
    with bar:
        result = evaluate(
            args.policy, args.env, seeds=args.seeds, episodes_per_seed=args.episodes_per_seed,
            env_kwargs=dict(args.env_arg), image=args.image, max_steps=args.max_steps,
            concurrency=args.concurrency, timeout=args.timeout, retries=args.retries,
            episodes_per_sandbox=args.episodes_per_sandbox, sandbox=sandbox,
            adaptive=args.adaptive, target_halfwidth=args.target_halfwidth,
            budget_episodes=args.budget, budget_seconds=args.budget_seconds,
            batch_size=args.batch_size, confidence=args.confidence,
            on_error=args.on_error if args.on_error is not None else "raise",
            error_return=args.error_return, ci_method=args.ci_method, bounds=args.bounds,
            cache=False if args.no_cache else (args.cache or True),
            png=args.png, progress=bar, client=ctx.client,
        )
    if args.json:
        out.json(result.to_dict())
    else:
        out.out.print(result.table())
        if args.per_seed:
            out.out.print(result.per_seed_table())
        extra = f", stopped: {result.stop_reason}" if args.adaptive else ""
        out.line(f"{len(result.episodes)} episodes in {result.elapsed_s:.2f} s "
                 f"({result.cache_hits} from the cache, {result.sandboxes_created} sandboxes)"
                 f"{extra}")
        if args.png:
            out.line(f"return distribution: {args.png}")
        failed = result.errors + result.timeouts
        if failed:
            out.line(f"the policy failed in {failed} of {len(result.episodes)} episodes "
                     f"({result.errors} errors, {result.timeouts} timeouts), scored: "
                     f"{result.errors_scored}; n={result.n} in the mean")
    if result.deterministic is False:
        out.error("warning: a re-run episode took another trajectory: the policy draws "
                  "randomness its seeding does not reach (os.urandom, the clock, an unseeded "
                  "generator), so its results are not cached and the same seeds give other "
                  "returns")
    if result.infra_failures:
        out.error(f"{result.infra_failures} episodes failed for infrastructure reasons and are "
                  "not scored: run the command again to fill them in (the rest is cached)")
        return 1
    return 0
