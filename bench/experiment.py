"""The mismatch study: what do the corrections buy as the engine drifts from the trainer?

Each setting fixes where the sampler's probabilities come from, and each is trained with
--loss reinforce (no correction), tis (truncated importance weights, --tis-cap 2) and
icepop (--icepop-beta 2.0, as in the README's main job), over --seeds seeds:
- --engine-dtype bf16 and fp8 (the built-in engine's W8A8 emulation), each synchronous
  and two steps stale (--async-level 2, colocated);
- --engine-noise s (the controlled knob: i.i.d. logit noise in the rollouts, not a real
  engine's error), synchronous;
- and two reinforce-only references, synchronous: an fp32 engine (no mismatch beyond
  rounding) and an fp16 trainer with an fp16 engine (--train-dtype fp16: the numeric
  format a 2025 study proposes against bf16's mismatch).

--harsh races every correction (ARMS: also DPPO's directional TV mask, M2PO, SAPO, TOPR, Kimi
K2.5's (log r)^2 term and a KL to the starting model) at mismatches where plain reinforce
degrades: --async-level 8, fp8 at 4, 3x the noise alone and at 2; it writes its own section
of --md ("## The race at harsher settings"), leaving the study's and any hand-written one.

Each run is `train.main([...])` in this process, one after another, in
`<out>/<setting>-<loss>-s<seed>/` (its log beside it, in `<setting>-<loss>-s<seed>.log`: a run
directory holds only its run, run/rundir.py). At the end
`<out>/results.md` (its grid's section of docs/mismatch-study.md by default) holds one table row per
setting and loss: mismatch KL (k3 on the sampled tokens, mean over steps and seeds), the
loss's own masked or clipped fraction, the held-out reward at step 0 and at the end (mean ±
std over seeds), the gap to reinforce in the same setting (paired by seed: mean ± std of
the per-seed differences, and whether the mean exceeds 2 of those std), and how many seeds
collapsed: a final held-out reward below its step-0 value, or a mean entropy under 0.05
nats over the last 5 steps. `--png`: final reward (mean ± std) and mismatch KL per setting.

Simplifications:
1. Sequential and in-process: on a 2-core CPU parallel runs only share the cores and
   oversubscribed torch threads slow each step many-fold, corrupting the wall-time column.
2. A run directory holding `result.json` for the same train flags is not run again, so an
   interrupted study picks up at the run it stopped in (that run starts over).
3. The held-out reward is sampled by the run's own engine (train.py's eval): the fp8 rows
   evaluate through the fp8 engine; the noise rows evaluate noise-free (only rollouts get it).
4. On a CPU without fp16 matmul units the fp16 trainer is several times slower than fp32
   (autocast pays conversions; docs/experiments.md "2026-12-01: the mismatch study" has its
   wall time), and it is most of the study's time; on a GPU it is the fast one.

    python bench/experiment.py                       # the whole grid: 51 runs of 60 steps, ~37 min on 2 CPU cores
    python bench/experiment.py --harsh --out runs/race      # the race: 120 runs of 60 steps, 10-30 s each on 2 CPU cores
    python bench/experiment.py --model /path/to/Qwen3-0.6B --device cuda --extra "--max-new-tokens 256"
    python bench/experiment.py --seeds 1 --steps 2 --only bf16 --out runs/exp-smoke --md "" --png runs/exp-smoke.png \\
        --extra "--prompts-per-step 2 --group-size 2 --eval-prompts 4 --max-new-tokens 8"   # smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import shlex
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

import plot  # noqa: E402
import train  # noqa: E402



@dataclass(frozen=True)
class Arm:
    """One correction of the race: train.py's --loss, the flags that make it this correction, and the
    metric (loss.py's) of the fraction of loss tokens it masks, clips or truncates ("": none, a regularizer)."""

    loss: str
    flags: tuple = ()
    fraction: str = ""


ARMS = {
    "reinforce": Arm("reinforce"),
    "tis": Arm("tis", ("--tis-cap", "2.0"), "tis/clip_fraction"),
    "icepop": Arm("icepop", ("--icepop-beta", "2.0"), "icepop/masked_fraction"),
    # DPPO's Binary-TV: tis with the directional TV mask (docs/design.md "Sequence and KL masks")
    "dppo": Arm("tis", ("--tis-cap", "2.0", "--kl-mask", "binary_tv", "--kl-mask-threshold", "0.2",
                        "--kl-mask-directional"), "kl_mask/masked_fraction"),
    "m2po": Arm("reinforce", ("--m2po-threshold", "0.04"), "m2po/masked_fraction"),
    "sapo": Arm("sapo"),  # a soft gate on p/pi_old, removing no token: at one update per step its weight is 1
    "ppo": Arm("ppo", (), "ppo/clip_fraction"),  # sapo's control: clipped on p/pi_old too, and like it not centered
    "topr": Arm("topr", (), "topr/clip_fraction"),
    "kimi": Arm("reinforce", ("--log-ratio-coeff", "0.1")),  # Kimi K2.5's tau (log r)^2, a regularizer
    # GRPO's KL to the starting model: distillation with the student's own start as the teacher
    "kl-ref": Arm("reinforce", ("--teacher", "checkpoints/reverse-tiny", "--distill-coeff", "0.1")),
}
STUDY = ("reinforce", "tis", "icepop")  # the study's settings run these; the harsh ones race every arm
# a smaller batch than train.py's default (32 x 16) so the grid fits in an hour on 2 cores
BATCH = ["--prompts-per-step", "16", "--group-size", "8"]


@dataclass(frozen=True)
class Setting:
    """Where the sampler's probabilities come from: one row group of the table."""

    engine: str = "bf16"  # --engine-dtype
    stale: int = 0  # --async-level
    train: str = "fp32"  # --train-dtype
    noise: float = 0.0  # --engine-noise
    losses: tuple = STUDY

    @property
    def name(self) -> str:
        noise = f"-noise{self.noise:g}" if self.noise else ""
        train = f"-train{self.train}" if self.train != "fp32" else ""
        return f"{self.engine}{train}{noise}-a{self.stale}"

    def flags(self) -> list[str]:
        noise = ["--engine-noise", f"{self.noise:g}", "--engine", "torch"] if self.noise else []  # vLLM has no knob
        return ["--engine-dtype", self.engine, "--async-level", str(self.stale), "--train-dtype", self.train, *noise]


def settings(noise: float, harsh: bool = False) -> list[Setting]:
    if harsh:  # mismatches past the study's, where plain reinforce degrades or collapses: the race
        race = tuple(ARMS)
        return [Setting("bf16", 8, losses=race), Setting("fp8", 4, losses=race), Setting(noise=3 * noise, losses=race),
                Setting(noise=3 * noise, stale=2, losses=race)]
    grid = [Setting(engine, stale) for engine in ("bf16", "fp8") for stale in (0, 2)]
    return grid + [Setting(noise=noise), Setting("fp32", losses=("reinforce",)),
                   Setting("fp16", train="fp16", losses=("reinforce",))]


def run_args(s: Setting, loss: str, seed: int, steps: int, run_dir: Path, extra: list[str]) -> list[str]:
    """train.py flags of one run; --extra comes last, and the last value of a flag wins."""
    return ["--loss", ARMS[loss].loss, *ARMS[loss].flags, *s.flags(), "--seed", str(seed), "--steps", str(steps), *BATCH,
            "--out-dir", str(run_dir), *extra]


def run_one(args: list[str], run_dir: Path) -> dict:
    """train.main in this process, its stdout to <run_dir>.log; result.json makes a rerun a no-op."""
    done = run_dir / "result.json"
    if done.is_file() and json.loads(done.read_text())["args"] == args:
        return {**json.loads(done.read_text()), "reused": True}
    shutil.rmtree(run_dir, ignore_errors=True)  # the study's own directory: a changed run starts over
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(run_dir.with_name(run_dir.name + ".log"), "w") as f, contextlib.redirect_stdout(f):
        summary = train.main(args)
    result = {"args": args, "wall_s": time.perf_counter() - t0, "summary": summary}
    done.write_text(json.dumps(result, indent=2))
    return result


def run_stats(loss: str, run_dir: Path, wall_s: float) -> dict:
    """One run's numbers, from its metrics.jsonl."""
    rows = plot.load(run_dir)
    steps = [r for r in rows if "loss" in r]  # the train rows (an eval-only row has no loss)
    evals = [r["eval/reward"] for r in rows if "eval/reward" in r]
    frac = [r[ARMS[loss].fraction] for r in steps if ARMS[loss].fraction in r]
    entropy = statistics.fmean(r["entropy"] for r in steps[-5:])
    return {"eval0": evals[0], "eval": evals[-1], "kl": statistics.fmean(r["mismatch/kl"] for r in steps),
            "frac": statistics.fmean(frac) if frac else None, "entropy": entropy, "wall_s": wall_s,
            "collapsed": evals[-1] < evals[0] or entropy < 0.05}


def _mean_std(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0


def _ms(xs: list[float]) -> str:
    return "{:.3f} ± {:.3f}".format(*_mean_std(xs))


def gap(runs: list[dict], base: list[dict]) -> tuple[float, float] | None:
    """The paired per-seed difference in final held-out reward against `base` (mean, std)."""
    if runs is base or len(runs) != len(base):
        return None
    return _mean_std([r["eval"] - b["eval"] for r, b in zip(runs, base)])


def table(stats: dict[tuple[Setting, str], list[dict]]) -> str:
    lines = ["| setting | loss | seeds | mismatch kl | masked/clipped | reward @0 | reward, final "
             "| vs reinforce | > 2 std | collapsed | wall s/run |", "|" + " --- |" * 11]
    for (s, loss), runs in stats.items():
        frac = [r["frac"] for r in runs]
        g = gap(runs, stats.get((s, "reinforce"), runs))
        wins = "-" if g is None or len(runs) < 2 else ("yes" if abs(g[0]) > 2 * g[1] else "no")
        lines.append(f"| {s.name} | {loss} | {len(runs)} | {statistics.fmean(r['kl'] for r in runs):.2e} "
                     f"| {'-' if None in frac else f'{statistics.fmean(frac):.2e}'} "
                     f"| {_ms([r['eval0'] for r in runs])} | {_ms([r['eval'] for r in runs])} "
                     f"| {'-' if g is None else f'{g[0]:+.3f} ± {g[1]:.3f}'} | {wins} "
                     f"| {sum(r['collapsed'] for r in runs)}/{len(runs)} "
                     f"| {statistics.fmean(r['wall_s'] for r in runs):.0f} |")
    return "\n".join(lines)


def figure(stats: dict[tuple[Setting, str], list[dict]], png: str) -> None:
    """Final held-out reward (mean ± std over seeds) and mismatch KL, per setting and loss."""
    names = list(dict.fromkeys(s.name for s, _ in stats))
    fig = Figure(figsize=(11, 7))
    top, bottom = fig.add_subplot(2, 1, 1), fig.add_subplot(2, 1, 2)
    arms = list(dict.fromkeys(lo for _, lo in stats))
    for j, loss in enumerate(arms):
        cells = [(s, runs) for (s, lo), runs in stats.items() if lo == loss]
        xs = [names.index(s.name) + (j - (len(arms) - 1) / 2) * 0.8 / len(arms) for s, _ in cells]
        ys, es = zip(*[_mean_std([r["eval"] for r in runs]) for _, runs in cells]) if cells else ((), ())
        top.errorbar(xs, ys, yerr=es, fmt="o", capsize=3, label=loss)
        bottom.scatter(xs, [max(statistics.fmean(r["kl"] for r in runs), 1e-12) for _, runs in cells], label=loss)
    start = statistics.fmean(r["eval0"] for runs in stats.values() for r in runs)
    top.axhline(start, ls="--", color="gray", lw=1, label="step 0 (mean)")
    top.set_ylabel("held-out reward, final")
    bottom.set_ylabel("mismatch kl (k3), log")
    bottom.set_yscale("log")
    for ax in (top, bottom):
        ax.set_xticks(range(len(names)), names, rotation=20, fontsize=8)
        ax.grid(alpha=0.3)
    top.legend(ncol=min(len(arms), 5), fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def report(argv: list[str], example: list[str], stats: dict, total_s: float, title: str = "# Mismatch study") -> str:
    date = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    return (f"{title}\n\n{date}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
            f"{total_s / 60:.0f} min of runs\n\n    python bench/experiment.py {shlex.join(argv)}\n\n"
            f"One run (the setting, loss and seed vary):\n\n    python train.py {shlex.join(example)}\n\n"
            f"{table(stats)}\n\nSettings: engine dtype, `-train<dtype>` a non-fp32 trainer, `-noise<s>` the "
            "--engine-noise knob, `-a<k>` --async-level. Reward: the held-out prompts (--eval-prompts, one set "
            "for every seed), 4 samples each, mean ± std over seeds. vs reinforce: the final reward minus "
            "reinforce's in the same setting, per seed, mean ± std; > 2 std: whether that mean is more than "
            "twice its std. Collapsed: final reward below step 0's, or entropy under 0.05 nats over the last "
            "5 steps. Mismatch kl, masked/clipped (the loss's own) and wall time: means over steps and seeds.\n")


RACE = "## The race at harsher settings"  # --harsh's section of --md, after the study's own


def splice(text: str, section: str) -> str:
    """`text` (a markdown file) with the section whose heading is `section`'s first line replaced by
    `section`, or appended where it has none; a section runs to the next `## ` heading. The file's
    other sections, the hand-written reading among them, stay as they are."""
    heading, lines = section.splitlines()[0], text.splitlines(keepends=True)
    starts = [i for i, line in enumerate(lines) if line.rstrip("\n") == heading]
    if not starts:
        return text.rstrip("\n") + "\n\n" + section
    end = next((j for j in range(starts[0] + 1, len(lines)) if lines[j].startswith("## ")), len(lines))
    return "".join(lines[:starts[0]]) + section + ("\n" if end < len(lines) else "") + "".join(lines[end:])


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description="engine dtype x staleness x loss, plus references, on reverse-text")
    ap.add_argument("--steps", type=int, default=60, help="RL steps per run")
    ap.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 per configuration")
    ap.add_argument("--noise", type=float, default=1.0, help="--engine-noise of the knob setting")
    ap.add_argument("--model", default=None, help="train.py --model for every run (default: the shipped tiny model)")
    ap.add_argument("--device", default=None, help="train.py --device for every run (cuda: the GPU run)")
    ap.add_argument("--only", default="", help="run only the settings whose name contains this")
    ap.add_argument("--harsh", action="store_true", help="the harsher settings (--async-level 8, fp8 at 4, "
                    "3x the noise, alone and at 2) in place of the study's")
    ap.add_argument("--losses", default="", help=f"run only these arms, of {', '.join(ARMS)} (comma-separated)")
    ap.add_argument("--out", default="runs/experiment", help="run directories and results.md")
    ap.add_argument("--md", default="docs/mismatch-study.md", help="a copy of results.md ('' for none)")
    ap.add_argument("--png", default=None, help="the summary figure (default docs/mismatch-study.png, "
                    "with --harsh docs/mismatch-race.png)")
    ap.add_argument("--extra", default="", help='more train.py flags for every run, e.g. "--max-new-tokens 16"')
    a = ap.parse_args(argv)
    if a.seeds < 1 or a.steps < 1:
        ap.error(f"--seeds and --steps must be >= 1, got {a.seeds} and {a.steps}")
    a.png = a.png or ("docs/mismatch-race.png" if a.harsh else "docs/mismatch-study.png")
    extra = shlex.split(a.extra) + (["--model", a.model] if a.model else []) + (["--device", a.device] if a.device else [])
    out = Path(a.out)
    only = set(a.losses.split(",")) if a.losses else set(ARMS)
    if only - set(ARMS):
        ap.error(f"--losses: {', '.join(sorted(only - set(ARMS)))} is none of {', '.join(ARMS)}")
    grid = [(s, loss, seed) for s in settings(a.noise, a.harsh) if a.only in s.name for loss in s.losses
            if loss in only for seed in range(a.seeds)]
    if not grid:
        ap.error(f"--only {a.only!r} matches no setting")
    stats: dict[tuple[Setting, str], list[dict]] = {}
    t0 = time.perf_counter()
    for i, (s, loss, seed) in enumerate(grid, 1):
        run_dir = out / f"{s.name}-{loss}-s{seed}"
        result = run_one(run_args(s, loss, seed, a.steps, run_dir, extra), run_dir)
        r = run_stats(loss, run_dir, result["wall_s"])
        stats.setdefault((s, loss), []).append(r)
        kept = " (kept from result.json)" if "reused" in result else ""
        print(f"[{i}/{len(grid)}] {run_dir.name}: eval reward {r['eval0']:.3f} -> {r['eval']:.3f}, "
              f"mismatch kl {r['kl']:.2e}, {r['wall_s']:.0f} s{kept}", flush=True)
    s0 = grid[0][0]
    md = report(argv, run_args(s0, "icepop", 0, a.steps, out / f"{s0.name}-icepop-s0", extra), stats,
                time.perf_counter() - t0, RACE if a.harsh else "# Mismatch study")
    (out / "results.md").write_text(md)
    if a.md:  # each grid rewrites its own section of the file
        Path(a.md).write_text(splice(Path(a.md).read_text() if Path(a.md).is_file() else "", md))
    figure(stats, a.png)
    print(table(stats))
    print(f"wrote {out / 'results.md'}{' and ' + a.md if a.md else ''} and {a.png}")
    return stats


if __name__ == "__main__":
    main()
