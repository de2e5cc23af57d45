"""Write a suite run as ``latest.json``, a markdown table (``latest.md``) and a bar
chart (``latest.png``). Used by ``run.py``; ``python3 benchmarks/report.py JSON``
redraws the table and chart from a saved JSON."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

# The peer table's figures: (key, column title, lower is better).
PEER_TABLE = (
    ("create_ready_ms_p50", "create→ready p50 ms", True),
    ("create_ready_ms_p95", "create→ready p95 ms", True),
    ("cycle_ms_p50", "create→`true`→destroy p50 ms", True),
    ("exec_rtt_ms_p50", "exec RTT p50 ms", True),
    ("mem_per_idle_sandbox_mb", "host MB / idle sandbox", True),
    ("pss_per_idle_sandbox_mb", "process PSS MB / idle sandbox", True),
    ("create_rate_per_s", "creates/s", False),
)
PEER_COLUMNS = tuple(key for key, _, _ in PEER_TABLE)
CHART = (
    ("cycle_ms_p50", "create → exec true → destroy, p50 (ms)", True),
    ("exec_rtt_ms_p50", "exec round trip in a running sandbox, p50 (ms)", True),
    ("pss_per_idle_sandbox_mb", "memory per idle sandbox: process PSS (MB)", True),
    ("create_rate_per_s", "sustained creates per second", False),
)
CORRAL_COLOR, PEER_COLOR = "#2a7ab0", "#b8b8b8"


def mem_uncertainty(row: dict[str, Any]) -> float:
    """How far a host-memory figure can be off: the largest of the host's own movement
    while it was read, over a round, and half the spread of the rounds."""
    return max(row.get(k) or 0.0 for k in ("mem_noise_mb", "mem_drift_mb", "mem_spread_mb"))


def meaningful(row: dict[str, Any], key: str) -> bool:
    """A figure a ratio can be taken of: measured, and for host memory, above noise."""
    value = row.get(key)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    if key == "mem_per_idle_sandbox_mb":
        return value > mem_uncertainty(row)
    return value > 0


def vs_corral(row: dict[str, Any], corral: dict[str, Any]) -> dict[str, float]:
    """Each figure of a peer over corral's. A peer with no ready signal of its own
    reports create→exec→destroy as create→ready: compare it with corral's cycle."""
    if "skipped" in row or "skipped" in corral or not corral:
        return {}
    out = {}
    for key in PEER_COLUMNS:
        theirs = key
        if key.startswith("create_ready") and row.get("create_ready_is") != corral.get(
                "create_ready_is"):
            theirs = key.replace("create_ready", "cycle")
        if meaningful(row, key) and meaningful(corral, theirs):
            out[key] = row[key] / corral[theirs]
    return out


def fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, int):
        return str(value)
    if abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.{digits}g}"


def ratio(r: float | None) -> str:
    if r is None:
        return "–"
    return f"{r:.2f}×" if r < 10 else f"{r:.0f}×"


# ------------------------------------------------------------------------- markdown


def markdown(res: dict[str, Any]) -> str:
    host = res.get("host", {})
    lines = [
        f"# corral benchmarks ({'quick' if res.get('quick') else 'full'} run)",
        "",
        f"`{res.get('command', 'make bench')}` on {res.get('started_at', '?')}: "
        f"{host.get('cpus')} CPUs, kernel {host.get('kernel')}, load "
        f"{host.get('loadavg_start', 0):.2f} → {host.get('loadavg_end', 0):.2f}, "
        f"{res.get('duration_s', 0):.0f} s. Every baseline was measured in this run.",
        "",
        "## Headline figures",
        "",
        "| key | corral | baseline (same run) | baseline | ratio |",
        "|---|---:|---|---:|---:|",
    ]
    not_measured = res.get("not_measured", {})
    for key, r in res.get("ratios", {}).items():
        if key in not_measured:
            continue
        value = r["value"]
        if key in ("humaneval_wall_ratio", "cartpole_ratio"):
            value = f"{fmt(res.get(key))} ({fmt(r['value'])} s)"
        lines.append(f"| `{key}` | {fmt(value) if not isinstance(value, str) else value} | "
                     f"{r['baseline']} | {fmt(r['baseline_value'])} | {ratio(r['ratio'])} |")
    for key, why in not_measured.items():
        lines.append(f"| `{key}` | null | {why} | | |")

    base = res.get("baselines", {})
    if base:
        corral = base.get("corral", {})
        lines += [
            "",
            "## corral and its peers",
            "",
            "One harness times every row (`benchmarks/peers/`); each cell is the figure and "
            "its ratio to corral's (for creates/s, higher is better).",
            "",
            "| system | " + " | ".join(title for _, title, _ in PEER_TABLE) + " |",
            "|---|" + "---:|" * len(PEER_TABLE),
        ]
        skipped = []
        for name, row in base.items():
            if "skipped" in row:
                skipped.append(f"- **{name}**: skipped: {row['skipped']}")
                continue
            rel = vs_corral(row, corral) if name != "corral" else {}
            cells = []
            for key, _, _ in PEER_TABLE:
                cell = fmt(row.get(key))
                if key == "mem_per_idle_sandbox_mb" and row.get("mem_idle_n"):
                    cell += f" ±{mem_uncertainty(row):.2f} (n={row['mem_idle_n']})"
                if key in rel:
                    cell += f" ({ratio(rel[key])})"
                if key.startswith("create_ready") and row.get("create_ready_is") != "create→ready":
                    cell += " †"
                cells.append(cell)
            lines.append(f"| {row.get('title', name)} | " + " | ".join(cells) + " |")
        lines += [
            "",
            "† no ready signal of its own: create→exec `true`→destroy (compared with "
            "corral's create→`true`→destroy).",
            "Host MB is MemTotal − MemAvailable per idle sandbox (the median of "
            f"{'1 round' if res.get('quick') else '3 rounds'}; other work on the host moves "
            "it, ± says how far); process PSS counts only the processes the system started "
            "(its daemon too; kernel memory not included).",
        ]
        if skipped:
            lines += ["", "Skipped (reason printed by the run too):", "", *skipped]

    he, cp = res.get("humaneval") or {}, res.get("cartpole") or {}
    if he or cp:
        lines += ["", "## Workloads", "", "| workload | corral | baseline | ratio |",
                  "|---|---:|---:|---:|"]
        if "error" in he:
            lines.append(f"| HumanEval | failed: {he['error']} | | |")
        elif he:
            lines.append(
                f"| HumanEval canonical solutions, one fresh sandbox each, "
                f"{he['humaneval_parallel']} at a time: {he['humaneval_pass']}/"
                f"{he['humaneval_total']} passed | {fmt(he['humaneval_wall_s'])} s | "
                f"{fmt(he['humaneval_subprocess_wall_s'])} s (plain `python3 -c`, "
                f"{he['humaneval_subprocess_pass']} passed) | {ratio(he['humaneval_wall_ratio'])} |")
        if "error" in cp:
            lines.append(f"| CartPole | failed: {cp['error']} | | |")
        elif cp:
            lines.append(
                f"| {cp['cartpole_episodes']} seeded CartPole-v1 episodes in "
                f"{cp['cartpole_workers']} sandboxes (setup {fmt(cp['cartpole_setup_s'])} s "
                f"apart), same records: {fmt(cp['cartpole_match'])} | "
                f"{fmt(cp['cartpole_1000_s'])} s | {fmt(cp['cartpole_inprocess_s'])} s "
                f"(in-process, one loop) | {ratio(cp['cartpole_ratio'])} |")
            lines.append(
                f"| the same, against {cp['cartpole_workers']} plain host processes | "
                f"{fmt(cp['cartpole_1000_s'])} s | {fmt(cp['cartpole_subprocess_s'])} s | "
                f"{ratio(cp['cartpole_subprocess_ratio'])} |")
    if res.get("quick"):
        lines += ["", "Quick run: fewer samples, 20 HumanEval problems and 100 CartPole "
                  "episodes (the keys keep their names)."]
    if res.get("failed"):
        lines += ["", f"**Failed:** {'; '.join(res['failed'])}"]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------- chart


def chart(res: dict[str, Any], path: Path) -> bool:
    """Bars of every measured system for the CHART figures; False if no matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib import ticker
    except ImportError:
        return False
    rows = {name: row for name, row in res.get("baselines", {}).items() if "skipped" not in row}
    if not rows:
        return False
    corral = rows.get("corral", {})
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    for ax, (key, title, lower) in zip(axes.flat, CHART, strict=True):
        names = [n for n, r in rows.items() if isinstance(r.get(key), (int, float))]
        values = [max(rows[n][key], 1e-3) for n in names]
        colors = [CORRAL_COLOR if n == "corral" else PEER_COLOR for n in names]
        bars = ax.barh([rows[n].get("title", n) for n in names], values, color=colors)
        ax.set_xscale("log")
        ax.invert_yaxis()
        ax.set_title(f"{title} — {'lower' if lower else 'higher'} is better", fontsize=10)
        for bar, n in zip(bars, names, strict=True):
            label = fmt(rows[n][key])
            if n != "corral" and corral.get(key):
                label += f"  ({ratio(rows[n][key] / corral[key])} corral)"
            ax.text(bar.get_width() * 1.05, bar.get_y() + bar.get_height() / 2, label,
                    va="center", fontsize=8)
        ax.set_xlim(min(values) / 3, max(values) * 12)
        ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda v, _: fmt(v)))
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())
        ax.tick_params(axis="y", labelsize=8)
    host = res.get("host", {})
    fig.suptitle(f"corral vs peers, one run ({'quick' if res.get('quick') else 'full'}; "
                 f"{host.get('cpus')} CPUs, kernel {host.get('kernel')})", fontsize=12)
    fig.tight_layout()
    fig.savefig(path, dpi=110, format="png")
    plt.close(fig)
    return True


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def write(res: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    """Write latest.json, latest.md and (with matplotlib) latest.png into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "latest.json", "md": out_dir / "latest.md"}
    _atomic_write(paths["json"], (json.dumps(res, indent=2, sort_keys=True) + "\n").encode())
    _atomic_write(paths["md"], markdown(res).encode())
    png = out_dir / "latest.png"
    tmp = out_dir / "latest.png.tmp"
    if chart(res, tmp):
        os.replace(tmp, png)
        paths["png"] = png
    return paths


if __name__ == "__main__":
    saved = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "results/latest.json")
    for p in write(json.loads(saved.read_text()), saved.parent).values():
        print(p)
