"""The mismatch experiment: what do IcePop and IPO buy when the engine's numerics differ
from the trainer's?

The grid is --loss reinforce, icepop (--icepop-beta 2.0, as in the README's main command)
and ipo x --engine-dtype bf16, fp16 and fp32 x --seeds seeds, each a short RL run of the
shipped tiny model on reverse-text. The trainer always keeps fp32 weights, so the engine
dtype sets the size of the training-inference mismatch and fp32 is the no-mismatch
control. Each run is `train.main([...])` in this process, one after another, in
`<out>/<loss>-<dtype>-s<seed>/` (its log lines in `train.log` there). At the end:
`<out>/results.md`, a table per configuration (held-out reward at step 0 and at the end,
mean ± std over seeds; the loss's own masked fraction, the mismatch KL and the wall time
per run, means over steps and seeds), headed by the command and the date; and `--png`,
plot.py's four panels with one line per configuration (the mean over its seeds).

Simplifications:
1. Sequential and in-process: on a 2-core CPU, parallel runs only share the cores, and
   oversubscribed torch threads slow a step many-fold (measured: ~1 s/step on quiet cores,
   15-30 s while other jobs shared them), which would also corrupt the wall-time column.
   Run it on a quiet machine.
2. A run directory holding `result.json` for the same train flags is not run again, so an
   interrupted experiment picks up at the run it stopped in (that run starts over).
3. The std is over seeds with n - 1 (0 for one seed); a reinforce run masks nothing and
   has no masked fraction ("-").

    python bench/experiment.py                      # the whole grid: 27 runs x ~46 s, ~21 min on 2 quiet CPU cores
    python bench/experiment.py --seeds 1 --steps 2 --out /tmp/exp --png /tmp/exp.png \\
        --extra "--prompts-per-step 2 --group-size 2 --eval-prompts 4 --max-new-tokens 8"   # smoke test, ~10 s
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import shutil
import shlex
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import plot  # noqa: E402
import train  # noqa: E402

LOSSES = {"reinforce": [], "icepop": ["--icepop-beta", "2.0"], "ipo": []}
DTYPES = ["bf16", "fp16", "fp32"]
# a smaller batch than train.py's default (32 x 16) so 27 runs fit in ~25 min on 2 cores: one
# 40-step run (icepop, bf16) took 46 s, ~1.05 s/step plus 5 evals (2026-11-30, 2 quiet cores)
BATCH = ["--prompts-per-step", "16", "--group-size", "8"]


def run_args(loss: str, dtype: str, seed: int, steps: int, run_dir: Path, extra: list[str]) -> list[str]:
    """train.py flags of one run; --extra comes last, and the last value of a flag wins."""
    return (["--loss", loss, *LOSSES[loss], "--engine-dtype", dtype, "--seed", str(seed), "--steps", str(steps),
             *BATCH, "--out-dir", str(run_dir), *extra])


def run_one(args: list[str], run_dir: Path) -> dict:
    """train.main in this process, its stdout to train.log; result.json makes a rerun a no-op."""
    done = run_dir / "result.json"
    if done.is_file() and json.loads(done.read_text())["args"] == args:
        return {**json.loads(done.read_text()), "reused": True}
    shutil.rmtree(run_dir, ignore_errors=True)  # the bench's own directory: a changed run starts over
    run_dir.mkdir(parents=True)
    t0 = time.perf_counter()
    with open(run_dir / "train.log", "w") as f, contextlib.redirect_stdout(f):
        summary = train.main(args)
    result = {"args": args, "wall_s": time.perf_counter() - t0, "summary": summary}
    done.write_text(json.dumps(result, indent=2))
    return result


def run_stats(loss: str, run_dir: Path, result: dict) -> dict:
    """One run's numbers for the table, from its metrics.jsonl."""
    rows = plot.load(run_dir)
    steps = [r for r in rows if "loss" in r]  # the train rows (an eval-only row has no loss)
    masked = [r[f"{loss}/masked_fraction"] for r in steps if f"{loss}/masked_fraction" in r]
    evals = [r["eval/reward"] for r in rows if "eval/reward" in r]
    return {"eval0": evals[0] if evals else None, "eval": evals[-1] if evals else None,
            "masked": statistics.fmean(masked) if masked else None,
            "kl": statistics.fmean(r["mismatch/kl"] for r in steps), "wall_s": result["wall_s"]}


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _mean_std(xs: list) -> str:
    if any(x is None for x in xs):
        return "-"
    std = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{statistics.fmean(xs):.3f} ± {std:.3f}"


def table(stats: dict[tuple[str, str], list[dict]]) -> str:
    lines = ["| loss | engine dtype | seeds | eval reward @0 | eval reward, final | masked fraction | mismatch kl "
             "| wall s/run |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (loss, dtype), runs in stats.items():
        masked = [s["masked"] for s in runs]
        masked_s = "-" if None in masked else f"{statistics.fmean(masked):.2e}"
        kl, wall = statistics.fmean(s["kl"] for s in runs), statistics.fmean(s["wall_s"] for s in runs)
        lines.append(f"| {loss} | {dtype} | {len(runs)} | {_mean_std([s['eval0'] for s in runs])} "
                     f"| {_mean_std([s['eval'] for s in runs])} | {masked_s} | {kl:.2e} | {wall:.1f} |")
    return "\n".join(lines)


def report(argv: list[str], example: list[str], stats: dict) -> str:
    date = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    return (f"# Mismatch experiment\n\n{date}, torch {torch.__version__}, {torch.get_num_threads()} threads\n\n"
            f"    python bench/experiment.py {shlex.join(argv)}\n\n"
            f"One run (the loss, dtype and seed vary):\n\n    python train.py {shlex.join(example)}\n\n"
            f"{table(stats)}\n\nEval reward: mean over the held-out prompts (--eval-prompts, the same "
            "set for every seed), 4 samples each; mean ± std over seeds. "
            "Masked fraction (the loss's own mask), mismatch kl (k3 on the sampled tokens) and wall time: "
            "means over steps and seeds.\n")


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description="reinforce/icepop/ipo x engine dtype x seeds on reverse-text")
    ap.add_argument("--steps", type=int, default=40, help="RL steps per run")
    ap.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 per configuration")
    ap.add_argument("--out", default="runs/experiment", help="run directories and results.md")
    ap.add_argument("--png", default="docs/experiment.png", help="the curves, one line per configuration")
    ap.add_argument("--extra", default="", help='more train.py flags for every run, e.g. "--max-new-tokens 16"')
    a = ap.parse_args(argv)
    if a.seeds < 1:
        ap.error(f"--seeds must be >= 1, got {a.seeds}")
    out, extra = Path(a.out), shlex.split(a.extra)
    grid = [(loss, dtype, seed) for loss in LOSSES for dtype in DTYPES for seed in range(a.seeds)]
    stats: dict[tuple[str, str], list[dict]] = {}
    labels = {}
    for i, (loss, dtype, seed) in enumerate(grid, 1):
        run_dir = out / f"{loss}-{dtype}-s{seed}"
        result = run_one(run_args(loss, dtype, seed, a.steps, run_dir, extra), run_dir)
        s = run_stats(loss, run_dir, result)
        stats.setdefault((loss, dtype), []).append(s)
        labels[run_dir] = f"{loss} {dtype}"
        kept = " (kept from result.json)" if "reused" in result else ""
        print(f"[{i}/{len(grid)}] {run_dir.name}: eval reward {_fmt(s['eval0'])} -> {_fmt(s['eval'])}, "
              f"mismatch kl {s['kl']:.2e}, {s['wall_s']:.0f} s{kept}", flush=True)
    example = run_args("icepop", "bf16", 0, a.steps, out / "icepop-bf16-s0", extra)
    (out / "results.md").write_text(report(argv, example, stats))
    plot.plot(list(labels), a.png, group=labels.__getitem__)
    print(f"wrote {out / 'results.md'} and {a.png}")
    return stats


if __name__ == "__main__":
    main()
