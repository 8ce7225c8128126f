"""On-policy distillation on the CPU: does a teacher's per-token signal teach the student faster
than the task's reward alone?

    python bench/distill.py                 # teacher, then 5 arms x 3 seeds: ~20 min on 2 cores, alone
    python bench/distill.py --steps 2 --teacher-steps 2 --seeds 1 --estimators k1 --out runs/distill-smoke --md "" --png "" \\
        --extra "--prompts-per-step 2 --group-size 2 --eval-prompts 4"   # smoke test

1. The teacher is trained here, by floe, from the shipped reverse-tiny: the README's main job for
   --teacher-steps steps at a seed none of the students uses (`python train.py --loss icepop
   --icepop-beta 2.0 --steps N --seed 100 --out-dir <out>/teacher`); its last checkpoint
   (`<out>/teacher/final`) is the teacher, its last held-out reward the table's ceiling line.
2. Three arms, each from reverse-tiny's start, --steps steps, seeds 0..--seeds-1:
   - rl: the README's main job (reward only);
   - distill: pure distillation, `--teacher T --distill-coeff λ --adv-tau 0` (the reward is
     logged, not trained on: its advantage is multiplied by 0);
   - rl+distill: the main job plus `--teacher T --distill-coeff λ`.
   Both distillation arms run with each of --estimators: k1 (the sampled token's log p - log t as
   a negative advantage) and exact (over each token's support row, the main job's K draws; those
   arms are named `distill-exact`, `rl+distill-exact`).
3. The table: held-out reward (train.py's eval, the same prompts for every run) at each eval step,
   mean over seeds, the final reward mean ± std, and the reward at equal wall time: each run's
   cumulative time/step (train steps only; the evals, the same for every arm, are left out) is
   cut at the shortest run's total, and the run's last eval within it is taken; time/teacher is the
   median of the teacher's forwards a step.
4. The figure: held-out reward against step and against that cumulative time, one line per arm
   (the mean over seeds), the teacher's reward dashed.

Each run is train.main in this process (bench/experiment.py's `run_one`: a run directory holding
result.json for the same flags is not run again, so an interrupted demo picks up where it stopped).
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

import plot  # noqa: E402
from experiment import _ms, run_one  # noqa: E402  (train.main in this process, a finished run reused)

MAIN = ["--loss", "icepop", "--icepop-beta", "2.0"]  # the README's main job
TEACHER_SEED = 100  # no student seed: the teacher's rollouts are not any student's


def arms(teacher: Path, coeff: float, estimators: list[str]) -> dict[str, list[str]]:
    """Each arm's flags, by the name its runs' directories take (k1's plain, exact's marked)."""
    out = {"rl": MAIN}
    for est in estimators:
        distill = ["--teacher", str(teacher), "--distill-coeff", f"{coeff:g}", "--distill-estimator", est]
        mark = "" if est == "k1" else f"-{est}"
        out |= {f"distill{mark}": [*MAIN, *distill, "--adv-tau", "0"], f"rl+distill{mark}": [*MAIN, *distill]}
    return out


def curve(run_dir: Path) -> list[tuple[int, float, float]]:
    """(step, cumulative train seconds up to it, held-out reward) at each eval of a run."""
    rows, clock, out = plot.load(run_dir), {0: 0.0}, []
    for r in rows:
        if "time/step" in r:
            clock[r["step"]] = clock[max(clock)] + r["time/step"]
    for r in rows:
        if "eval/reward" in r:
            out.append((r["step"], clock[r["step"]], r["eval/reward"]))
    return out


def at_time(c: list[tuple[int, float, float]], budget: float) -> float:
    return [reward for _, t, reward in c if t <= budget + 1e-9][-1]


def table(runs: dict[str, list[Path]], teacher_reward: float) -> str:
    curves = {arm: [curve(d) for d in dirs] for arm, dirs in runs.items()}
    steps = [s for s, _, _ in next(iter(curves.values()))[0]]
    budget = min(c[-1][1] for cs in curves.values() for c in cs)
    lines = [f"| arm | held-out reward at steps {', '.join(map(str, steps))} (mean) | final | "
             f"at {budget:.0f} s of steps | s per step | time/teacher | distill/kl, last step |", "| --- " * 7 + "|"]
    for arm, cs in curves.items():
        by_step = " ".join(f"{statistics.fmean(c[i][2] for c in cs):.3f}" for i in range(len(steps)))
        rows = [plot.load(d) for d in runs[arm]]
        kl = [r[-1]["distill/kl"] for r in rows if "distill/kl" in r[-1]]
        teach = [x["time/teacher"] for r in rows for x in r if "time/teacher" in x]
        lines.append(f"| {arm} | {by_step} | {_ms([c[-1][2] for c in cs])} | {_ms([at_time(c, budget) for c in cs])} "
                     f"| {statistics.fmean(c[-1][1] / c[-1][0] for c in cs):.2f} "
                     f"| {f'{statistics.median(teach):.3f} s' if teach else '-'} | {f'{statistics.fmean(kl):.3f}' if kl else '-'} |")
    lines.append(f"| teacher | | {teacher_reward:.3f} | | | | |")
    return "\n".join(lines)


def figure(runs: dict[str, list[Path]], teacher_reward: float, png: str) -> None:
    fig = Figure(figsize=(11, 4))
    by_step, by_time = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for arm, dirs in runs.items():
        cs = [curve(d) for d in dirs]
        mean = [[statistics.fmean(c[i][k] for c in cs) for k in range(3)] for i in range(len(cs[0]))]
        by_step.plot([m[0] for m in mean], [m[2] for m in mean], marker="o", label=arm)
        by_time.plot([m[1] for m in mean], [m[2] for m in mean], marker="o", label=arm)
    for ax, x in ((by_step, "step"), (by_time, "cumulative seconds of train steps (evals excluded)")):
        ax.axhline(teacher_reward, ls="--", color="gray", lw=1, label="teacher")
        ax.set_xlabel(x)
        ax.set_ylabel("held-out reward (mean over seeds)")
        ax.grid(alpha=0.3)
    by_step.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=60, help="steps per student run")
    ap.add_argument("--teacher-steps", type=int, default=240, help="steps of the teacher's own RL run")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--coeff", type=float, default=1.0, help="--distill-coeff of both distillation arms")
    ap.add_argument("--estimators", default="k1,exact", help="--distill-estimator of the distillation arms, comma-separated")
    ap.add_argument("--out", default="runs/distill")
    ap.add_argument("--md", default="runs/distill/results.md", help="where the table goes ('' for none)")
    ap.add_argument("--png", default="docs/distill.png", help="the figure ('' for none)")
    ap.add_argument("--extra", default="", help="more train.py flags for every run, the teacher's included")
    a = ap.parse_args(argv)
    estimators = a.estimators.split(",")
    if not set(estimators) <= {"k1", "exact"} or not estimators:
        ap.error(f"--estimators takes k1 and/or exact, got {a.estimators!r}")
    if min(a.steps, a.teacher_steps, a.seeds) < 1:
        ap.error(f"--steps, --teacher-steps and --seeds must be >= 1, got {a.steps}, {a.teacher_steps}, {a.seeds}")
    out, extra, t0 = Path(a.out), shlex.split(a.extra), time.perf_counter()
    every = ["--eval-every", str(max(1, a.steps // 6))]
    teacher_args = [*MAIN, "--steps", str(a.teacher_steps), "--seed", str(TEACHER_SEED),
                    "--eval-every", str(a.teacher_steps), "--out-dir", str(out / "teacher"), *extra]
    run_one(teacher_args, out / "teacher")
    teacher_reward = curve(out / "teacher")[-1][2]
    print(f"teacher: {a.teacher_steps} steps, held-out reward {teacher_reward:.3f}", flush=True)
    runs: dict[str, list[Path]] = {}
    # seed by seed, every arm in turn: a drift in the machine's speed falls on every arm alike
    for seed in range(a.seeds):
        for arm, flags in arms(out / "teacher" / "final", a.coeff, estimators).items():
            run_dir = out / f"{arm}-s{seed}"
            result = run_one([*flags, "--steps", str(a.steps), "--seed", str(seed), *every,
                              "--out-dir", str(run_dir), *extra], run_dir)
            runs.setdefault(arm, []).append(run_dir)
            c = curve(run_dir)
            print(f"{run_dir.name}: held-out reward {c[0][2]:.3f} -> {c[-1][2]:.3f}, {result['wall_s']:.0f} s", flush=True)
    date = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    md = (f"{date}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{(time.perf_counter() - t0) / 60:.0f} min\n\n    python bench/distill.py {shlex.join(argv)}\n\n"
          f"{table(runs, teacher_reward)}\n")
    print(md)
    if a.md:
        Path(a.md).parent.mkdir(parents=True, exist_ok=True)
        Path(a.md).write_text(md)
    if a.png:
        figure(runs, teacher_reward, a.png)
        print(f"wrote {a.png}")


if __name__ == "__main__":
    main()
