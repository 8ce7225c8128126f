"""Rollouts that never wait: the synchronous loop, the fixed lag and the bound, with and without
partial rollouts, on one machine. `speed` times them, each run alone in its own process; `learn`
trains them to the held-out reward, 3 seeds, at equal steps and at equal wall time.

    python bench/staleness.py speed                 # 3 settings x 9 arms x 2 rounds of 24 steps: ~15 min on 2 cores
    python bench/staleness.py learn                 # 7 arms x icepop, reinforce x 3 seeds of 60 steps: ~8 min
    python bench/staleness.py learn --arms "sync,S8,S8 at 4" --losses icepop,reinforce,topr --out runs/staleness-s8
    python bench/staleness.py speed --steps 4 --rounds 1 --settings default --arms sync,S2 --out runs/staleness-smoke
    python bench/staleness.py speed --nproc 2 --extra "--inference-gpus 1"   # split: a trainer process and a sampler

1. The arms: sync; `--async-level 1`; `--max-staleness S` for S = 1, 2, 4 with `--no-partial-rollouts`
   (a push waits for the batch being sampled: "S<k> whole") and with partial rollouts ("S<k>"); and
   S = 2 with `--recompute-kv-on-push`. Beside them (`--arms`, and in `learn`) "S2 at 4" and "S4 at
   4": `--push-at-decode-step 4`, where every batch past the first S takes a push at its 4th decode
   step, so most sequences are sampled by two versions.
2. The settings: `default`, the README's main job (the sampler is the faster side on a CPU), and
   `tail`, the same at `--temperature 3 --max-new-tokens 96`: reverse-tiny's completions then have a
   long tail (median 10 tokens, the 99th percentile about 60), the case partial rollouts are for;
   and `sampler-bound`, the tail at 8 prompts x 4: on a CPU decoding a small batch costs about what
   a large one does a step, training far less, so the sampler is the slower side.
3. Each run is `train.py` in a subprocess with --eval-every 0 (evals would add the same time to
   every arm); rounds run every arm once, in turn, so a drift of the machine falls on all of them.
4. Per arm, over steps 3.. (steps 1-2 are warm-up): tokens trained per second (the sum of
   tokens/train over the sum of time/step: a step's time/step is the trainer's wall time for it,
   the wait for its batch included), the median time/step, and where the run logs them the mean
   async/sampler_idle, async/trainer_idle, async/spanning_push and staleness/mean. The table gives
   each round's tokens/s and their mean.

`learn`: the arms sync, a1, S2 whole, S2, S4, S2 at 4 and S4 at 4, each with --loss icepop (--icepop-beta 2) and
--loss reinforce, seeds 0..2, in this process (bench/experiment.py's run_one: a finished run is
not run again), at the mismatch study's batch (16 x 8); held-out reward every 10 steps; the
reward at equal wall time is each run's last eval within the shortest run's sum of time/step
(bench/distill.py's curve). The question it puts: does the mismatch correction keep stale,
mixed-policy sequences learning where plain REINFORCE drifts? `--arms` and `--losses` pick others
(S8, S8 at 4; topr), as at the bound of 8, where a fixed lag of 8 collapses REINFORCE (the race).

On 2 cores the two sides of a thread share them (each gets one: engines/pipeline.py), so the
figures say what overlap buys there, not what a GPU pair would.
"""

from __future__ import annotations

import argparse
import datetime
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import plot  # noqa: E402
MAIN = ["--loss", "icepop", "--icepop-beta", "2.0"]
SETTINGS = {"default": [], "tail": ["--temperature", "3", "--max-new-tokens", "96"],
            "sampler-bound": ["--temperature", "3", "--max-new-tokens", "96", "--prompts-per-step", "8", "--group-size", "4"]}
ARMS = {"sync": [], "a1": ["--async-level", "1"],
        **{f"S{s} whole": ["--max-staleness", str(s), "--no-partial-rollouts"] for s in (1, 2, 4)},
        **{f"S{s}": ["--max-staleness", str(s)] for s in (1, 2, 4)},
        "S2 recompute": ["--max-staleness", "2", "--recompute-kv-on-push"],
        **{f"S{s}": ["--max-staleness", str(s)] for s in (8,)},
        **{f"S{s} at 4": ["--max-staleness", str(s), "--push-at-decode-step", "4"] for s in (2, 4, 8)}}
SPEED_ARMS = ("sync", "a1", "S1 whole", "S2 whole", "S4 whole", "S1", "S2", "S4", "S2 recompute")
LOGGED = ("async/sampler_idle", "async/trainer_idle", "async/spanning_push", "staleness/mean")


def run(flags: list[str], out: Path, nproc: int = 0) -> list[dict]:
    """train.py in its own process (nproc > 0: under torchrun, nproc processes); its step rows."""
    launch = [sys.executable] + (["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)] if nproc else [])
    r = subprocess.run([*launch, str(ROOT / "train.py"), *flags, "--out-dir", str(out)], capture_output=True,
                       text=True, timeout=3600)
    if r.returncode:
        raise SystemExit(f"bench/staleness.py: {shlex.join(flags)} failed:\n{r.stderr[-2000:]}")
    return [x for x in plot.load(out) if "time/step" in x]


def figures(rows: list[dict]) -> dict:
    rows = rows[2:]
    out = {"tok/s": sum(r["tokens/train"] for r in rows) / sum(r["time/step"] for r in rows),
           "step": statistics.median(r["time/step"] for r in rows)}
    out.update({k: statistics.fmean(r[k] for r in rows) for k in LOGGED if k in rows[0]})
    return out


def table(results: dict) -> str:
    head = ["setting", "arm", "tokens trained/s, per round", "mean", "against sync", "median time/step",
            "sampler idle", "trainer idle", "spanning a push", "mean age"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for setting, arms in results.items():
        sync = statistics.fmean(f["tok/s"] for f in arms["sync"])
        for arm, runs in arms.items():
            mean = statistics.fmean(f["tok/s"] for f in runs)
            per_round = ", ".join(f"{f['tok/s']:,.0f}" for f in runs)
            logged = [f"{statistics.fmean(f[k] for f in runs):.2f}" if k in runs[0] else "-" for k in LOGGED]
            lines.append(f"| {setting} | {arm} | {per_round} | {mean:,.0f} | {mean / sync:.2f} | "
                         f"{statistics.fmean(f['step'] for f in runs):.3f} s | " + " | ".join(logged) + " |")
    return "\n".join(lines)


LEARN_ARMS = ("sync", "a1", "S2 whole", "S2", "S4", "S2 at 4", "S4 at 4")
LEARN_LOSSES = {"icepop": ["--loss", "icepop", "--icepop-beta", "2.0"], "reinforce": ["--loss", "reinforce"],
                "topr": ["--loss", "topr"]}  # topr: the race's best under staleness (bench/experiment.py)


def learn(argv: list[str]) -> str:
    from bench.distill import at_time, curve
    from bench.experiment import BATCH, _mean_std, _ms, run_one

    ap = argparse.ArgumentParser(prog="bench/staleness.py learn")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--out", default="runs/staleness-learn")
    ap.add_argument("--extra", default="", help="more train.py flags for every run")
    ap.add_argument("--arms", default=",".join(LEARN_ARMS), help=f"of {', '.join(ARMS)}")
    ap.add_argument("--losses", default="icepop,reinforce", help=f"of {', '.join(LEARN_LOSSES)}")
    a = ap.parse_args(argv)
    arms, losses = a.arms.split(","), a.losses.split(",")
    for name, known in (*((x, ARMS) for x in arms), *((x, LEARN_LOSSES) for x in losses)):
        if name not in known:
            ap.error(f"{name!r} is none of {', '.join(known)}")
    if "sync" not in arms:
        ap.error("--arms must hold sync: every arm's gap is paired with it")
    dirs: dict[tuple[str, str], list[Path]] = {}
    for seed in range(a.seeds):  # seed by seed, every arm in turn: a drift of the machine falls on all
        for loss in losses:
            for arm in arms:
                d = Path(a.out) / f"{loss}-{arm.replace(' ', '-')}-s{seed}"
                args = [*LEARN_LOSSES[loss], *ARMS[arm], *BATCH, "--steps", str(a.steps), "--eval-every", "10", "--seed",
                        str(seed), "--out-dir", str(d), *shlex.split(a.extra)]
                r = run_one(args, d)
                print(f"# {d.name}: eval {r['summary'].get('eval/reward', float('nan')):.3f}, {r['wall_s']:.0f} s", flush=True)
                dirs.setdefault((loss, arm), []).append(d)
    curves = {k: [curve(d) for d in ds] for k, ds in dirs.items()}
    budget = min(c[-1][1] for cs in curves.values() for c in cs)
    steps = [s for s, _, _ in next(iter(curves.values()))[0]]
    lines = [f"| loss | arm | held-out reward at steps {', '.join(map(str, steps))} (mean) | final | against sync, "
             f"paired | at {budget:.0f} s of steps | mean age | spanning a push | masked |", "|" + " --- |" * 9]
    for (loss, arm), cs in curves.items():
        final = [c[-1][2] for c in cs]
        sync = [c[-1][2] for c in curves[(loss, "sync")]]
        diff = [x - y for x, y in zip(final, sync)]
        rows = [[r for r in plot.load(d) if "time/step" in r] for d in dirs[(loss, arm)]]

        def mean_of(key):
            xs = [r[key] for rs in rows for r in rs if key in r]
            return f"{statistics.fmean(xs):.3f}" if xs else "-"
        by_step = " ".join(f"{statistics.fmean(c[i][2] for c in cs):.3f}" for i in range(len(steps)))
        lines.append(f"| {loss} | {arm} | {by_step} | {_ms(final)} | {'{:+.3f} ± {:.3f}'.format(*_mean_std(diff)) if arm != 'sync' else '-'} | "
                     f"{_ms([at_time(c, budget) for c in cs])} | {mean_of('staleness/mean')} | "
                     f"{mean_of('async/spanning_push')} | {mean_of('icepop/masked_fraction')} |")
    text = "\n".join(lines)
    print(f"# {datetime.date.today()}, {a.seeds} seeds of {a.steps} steps\n{text}")
    return text


def main(argv: list[str] | None = None) -> str:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["learn"]:
        return learn(argv[1:])
    if argv[:1] != ["speed"]:
        raise SystemExit("bench/staleness.py: give speed or learn first (the docstring has both)")
    ap = argparse.ArgumentParser(prog="bench/staleness.py speed")
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--arms", default=",".join(SPEED_ARMS), help=f"of {', '.join(ARMS)}")
    ap.add_argument("--out", default="runs/staleness")
    ap.add_argument("--extra", default="", help="more train.py flags for every run")
    ap.add_argument("--nproc", type=int, default=0, help="run each under torchrun with this many processes "
                    "(with --extra \"--inference-gpus 1\": a trainer and a sampler)")
    a = ap.parse_args(argv[1:])
    settings, arms = a.settings.split(","), a.arms.split(",")
    for name, known in (*((s, SETTINGS) for s in settings), *((x, ARMS) for x in arms)):
        if name not in known:
            ap.error(f"{name!r} is none of {', '.join(known)}")
    if "sync" not in arms:
        ap.error("--arms must hold sync: every row is read against it")
    results = {s: {x: [] for x in arms} for s in settings}
    t0 = time.perf_counter()
    for k in range(a.rounds):
        for s in settings:
            for x in arms:
                flags = [*MAIN, *SETTINGS[s], *ARMS[x], "--steps", str(a.steps), "--eval-every", "0",
                         *shlex.split(a.extra)]
                results[s][x].append(figures(run(flags, Path(a.out) / f"{s}-{x.replace(' ', '-')}-r{k}", a.nproc)))
                print(f"# round {k + 1}, {s}, {x}: {results[s][x][-1]['tok/s']:,.0f} tokens trained/s", flush=True)
    text = table(results)
    print(f"# {datetime.date.today()}, {a.rounds} rounds of {a.steps} steps, {time.perf_counter() - t0:.0f} s\n{text}")
    return text


if __name__ == "__main__":
    main()
