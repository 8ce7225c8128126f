"""Training curves of one or more floe runs, from their metrics.jsonl, in one PNG.

Four panels, one line per run (labelled by the run directory's name): the train reward
(`reward`, the mean over each step's rollouts), the held-out reward (`eval/reward`), the
share of loss tokens a correction masked or clipped (every `*/masked_fraction` and
`*/clip_fraction` the runs logged, one line style each, named in the panel's title) and the
trainer-sampler mismatch `mismatch/kl` (k3 on the sampled tokens) on a log scale.

Simplifications:
1. It reads only metrics.jsonl (docs/design.md "The run directory"): no config, no checkpoints, so
   it plots a run that is still going or one copied from another machine.
2. Runs given the same label by `plot(..., group=...)` become one line, their mean at the
   steps all of them logged (bench/experiment.py: the mean over seeds). No error bands:
   the experiment's table carries the spread.
3. A mismatch KL <= 0 (the fp32 engine matches the trainer up to rounding, and the k3
   estimate rounds to 0 or a hair below) has no place on a log axis; those points are
   left out rather than clipped to a fake floor, and markers keep the rest visible.
4. It draws on a bare matplotlib `Figure` (Agg, no pyplot): no display and no global
   figure state, so it runs on a headless box and inside other scripts.

    python plot.py runs/latest                              # -> runs/latest/curves.png
    python plot.py runs/icepop runs/reinforce --out cmp.png  # one line per run
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

# (title, metric names, log scale); line styles follow the names' order within a panel; None:
# the fractions the runs logged
PANELS = [("train reward", ["reward"], False),
          ("held-out reward (eval/reward)", ["eval/reward"], False),
          ("masked or clipped fraction", None, False),
          ("mismatch/kl (k3, log scale)", ["mismatch/kl"], True)]
STYLES = {"-": "solid", "--": "dashed", ":": "dotted", "-.": "dash-dot"}
FRACTIONS = ("/masked_fraction", "/clip_fraction")  # a correction's share of loss tokens (loss.py)


class PlotError(Exception):
    """A run whose metrics cannot be read; the message names the file."""


def load(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise PlotError(f"{path}: no such file (is {run_dir} a floe run directory?)")
    try:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except json.JSONDecodeError as e:
        raise PlotError(f"{path}: not one JSON object per line ({e})") from None
    if not rows:
        raise PlotError(f"{path}: empty, the run has not logged a step yet")
    return rows


def series(runs: list[list[dict]], key: str) -> tuple[list[int], list[float]]:
    """(steps, mean over runs) at the steps where every run logged `key`."""
    per_run = [{r["step"]: r[key] for r in rows if key in r} for rows in runs]
    steps = sorted(set.intersection(*(set(p) for p in per_run)))
    return steps, [sum(p[s] for p in per_run) / len(per_run) for s in steps]


def plot(run_dirs, out, group=None) -> Path:
    """Write the PNG; `group(run_dir) -> label` merges the runs sharing a label into their mean."""
    dirs = [Path(d) for d in run_dirs]
    names = [d.name for d in dirs]
    lines: dict[str, list[list[dict]]] = {}
    for d in dirs:  # a name shared by two ungrouped runs falls back to the full path
        label = group(d) if group else (d.name if names.count(d.name) == 1 else str(d))
        lines.setdefault(label, []).append(load(d))
    fig = Figure(figsize=(12, 7.5), layout="constrained")
    colors = _colors(len(lines))
    for ax, (title, keys, log) in zip(fig.subplots(2, 2).flat, PANELS):
        if keys is None:
            keys = sorted({k for runs in lines.values() for rows in runs for r in rows for k in r
                           if k.endswith(FRACTIONS)})[:len(STYLES)]
            title += "".join(f"\n{k} {s}" for k, s in zip(keys, STYLES.values()))
        _panel(ax, title, keys, log, lines, colors)
    fig.legend(handles=_handles(lines, colors), loc="outside right upper", fontsize=8)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out


def _panel(ax, title, keys, log, lines, colors) -> None:
    for color, runs in zip(colors, lines.values()):
        for style, key in zip(STYLES, keys):
            steps, values = series(runs, key)
            if steps:  # markers: eval rows are sparse, and a log axis drops values <= 0, isolating points
                marker = "o" if key == "eval/reward" or log else None
                ax.plot(steps, values, style, color=color, lw=1.3, ms=3, marker=marker)
    ax.set(title=title, xlabel="step")
    ax.grid(alpha=0.3)
    if not ax.lines:
        ax.text(0.5, 0.5, "not logged by these runs", ha="center", va="center", transform=ax.transAxes)
    elif log:
        ax.set_yscale("log", nonpositive="mask")


def _colors(n: int) -> list:
    cmap = colormaps["tab10" if n <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(n)]


def _handles(lines, colors) -> list:
    """One legend entry per line (run or group), by color: the panels share them."""
    return [Line2D([], [], color=c, lw=2, label=label) for c, label in zip(colors, lines)]


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description="Plot reward, masked fraction and mismatch KL of floe runs.")
    ap.add_argument("run_dirs", nargs="+", help="run directories, each holding a metrics.jsonl")
    ap.add_argument("--out", help="the PNG (default: RUN_DIR/curves.png for one run, curves.png for several)")
    args = ap.parse_args(argv)
    out = args.out or (Path(args.run_dirs[0]) / "curves.png" if len(args.run_dirs) == 1 else "curves.png")
    try:
        path = plot(args.run_dirs, out)
    except PlotError as e:
        print(f"plot: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
