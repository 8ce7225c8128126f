"""What --compile on changes in the numbers: fusion reorders float sums, so a compiled trainer
computes slightly different log-probs than an eager one. Is that difference new, or at the level of
the trainer-engine mismatch floe's corrections already handle?

    python bench/compiled.py logprobs            # per-token |log p| differences on one step's batch
    python bench/compiled.py runs --seeds 3      # two jobs, compiled and eager, 3 seeds each: ~20 min on 2 cores
    python bench/compiled.py region              # ms per micro-batch pass, eager vs the compiled trainer step

`logprobs` runs one eager step of the default job, keeps its packed micro-batches and weights,
and scores each micro-batch's loss tokens through the trainer's own forward and head
(train._head): eager, and through the compiled forward (torch.compile, as --compile on builds it).
Beside that difference it prints the two it must be judged against: eager at this dtype against
eager fp32 (what the dtype itself costs), and the engine's log-probs the rollout recorded
(mb.logq, the mismatch the corrections handle). Max and mean |log p| over the loss tokens, at
--train-dtype fp32 and bf16 (bf16 also with Inductor's emulate_precision_casts).

`region` times train.backward_pass (forward, head, loss and backward of each micro-batch) on one step's
batch, eager and through --compile on's `trainer step` region (run/start.py trainer_step), after warm-up:
the default job (one graph), and reinforce --top-p 0.9, whose CPU head takes the sparse backward, eager
inside the region (kernels._sparse_head: a graph break, two graphs), beside the same batch with the
dense backward, compiled whole: what the break costs against a region without it. Run it alone.

`runs` trains the default job (`--loss icepop --icepop-beta 2.0`) and `--loss ppo --icepop-mask
--async-level 2` (two steps stale) under --compile on and off for each seed, one `python
train.py` at a time (all runs share one Inductor cache under --out, so only the first compiled
run pays the compile). Per job and mode: the held-out reward at each eval (mean over seeds),
the final reward (mean +- std), mismatch/kl and the masked fraction (mean over steps and seeds),
and the compiled-minus-eager final reward paired by seed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from run.runlog import read_rows  # noqa: E402

JOBS = {
    "default": ["--loss", "icepop", "--icepop-beta", "2.0"],
    "ppo-icepop-stale2": ["--loss", "ppo", "--icepop-mask", "--async-level", "2"],
}
MASKED = "icepop/masked_fraction"


def one_step_batch(out: Path, flags: list[str] = JOBS["default"]):
    """The job's first step (the default job's unless `flags`), eager: its packed micro-batches, config,
    and the model as the step found it (the weights that sampled them: the rollout pushed these to the engine)."""
    import copy

    import train

    kept = {}
    backward_pass = train.backward_pass

    def keep(cfg, model, fwd, mbs, *args, **kwargs):
        kept.setdefault("batch", (cfg, copy.deepcopy(model), mbs))
        return backward_pass(cfg, model, fwd, mbs, *args, **kwargs)

    train.backward_pass = keep
    try:
        train.main([*flags, "--steps", "1", "--eval-every", "0", "--compile", "off", "--out-dir", str(out)])
    finally:
        train.backward_pass = backward_pass
    return kept["batch"]


def logprobs(args) -> None:
    import torch

    import train

    with tempfile.TemporaryDirectory() as tmp:
        cfg, model, mbs = one_step_batch(Path(tmp) / "run")
    print(f"{len(mbs)} micro-batches, {sum(int(mb.loss_mask.sum()) for mb in mbs)} loss tokens")
    print("| train dtype | compiled vs eager: max | mean | eager vs fp32 eager: max | mean | engine vs eager: max | mean |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    with torch.no_grad():
        fp32 = [train._head(cfg, model, model, mb)[0] for mb in mbs]
    # bf16 twice: Inductor as it ships (a fused kernel keeps fp32 between its operators) and with
    # emulate_precision_casts, which rounds where eager would
    for dtype, emulate in (("fp32", False), ("bf16", False), ("bf16", True)):
        c = dataclasses.replace(cfg, train_dtype=dtype)
        torch._dynamo.reset()
        fwd = torch.compile(model)
        d = {"compiled": [], "fp32": [], "engine": []}
        with torch.no_grad(), torch._inductor.config.patch(emulate_precision_casts=emulate):
            for mb, ref in zip(mbs, fp32):
                eager, m = train._head(c, model, model, mb)[0], mb.loss_mask
                for k, other in (("compiled", train._head(c, model, fwd, mb)[0]), ("fp32", ref), ("engine", mb.logq)):
                    d[k].append((other - eager)[m].abs().double())
        cells = " | ".join(f"{x.max():.2e} | {x.mean():.2e}" for x in map(torch.cat, d.values()))
        print(f"| {dtype}{' (emulate_precision_casts)' if emulate else ''} | {cells} |")


def region(args) -> None:
    import time

    import torch
    from torch._dynamo.utils import counters

    import train
    from loss import denominators
    from run.start import trainer_step

    print("| job | path | ms per step's passes (median) | graphs | graph breaks |")
    print("| --- | --- | --- | --- | --- |")
    sparse_ok = train.sparse_ok
    for job, flags in (("icepop (default)", JOBS["default"]), ("reinforce --top-p 0.9", ["--loss", "reinforce", "--top-p", "0.9"])):
        with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stdout(io.StringIO()):  # the run's lines
            cfg, model, mbs = one_step_batch(Path(tmp) / "run", flags)  # would split the table
        denom = denominators(mbs)
        paths = [("eager", None, sparse_ok), ("compiled", "on", sparse_ok)]
        if sparse_ok(cfg, mbs[0].support):
            paths.append(("compiled, dense backward (no break)", "on", lambda *a: False))
        for path, compile_, ok in paths:
            torch._dynamo.reset()
            counters.clear()
            train.sparse_ok = ok
            r = trainer_step(dataclasses.replace(cfg, compile=compile_), train.micro_loss) if compile_ else None
            ms = []
            for i in range(args.repeats + 2):  # two warm-up passes: the compile, then a graph that holds
                t0 = time.perf_counter()
                train.backward_pass(cfg, model, model, mbs, denom, 0, region=r)
                ms.append((time.perf_counter() - t0) * 1e3)
                model.zero_grad(set_to_none=True)
            train.sparse_ok = sparse_ok
            graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
            print(f"| {job} | {path} | {statistics.median(ms[2:]):.1f} | {graphs if r else '-'} | {breaks if r else '-'} |")


def run_one(job: str, mode: str, seed: int, out: Path, extra: list[str]) -> list[dict]:
    run = out / f"{job}-{mode}-s{seed}"
    if not (run / "done").exists():  # an interrupted study starts that run over
        shutil.rmtree(run, ignore_errors=True)
        cmd = [sys.executable, "train.py", *JOBS[job], "--compile", mode, "--seed", str(seed), "--out-dir", str(run), *extra]
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(out / "inductor-cache")}
        print(f"[{job} {mode} seed {seed}]", " ".join(cmd[1:]), flush=True)
        log = out / f"{job}-{mode}-s{seed}.log"
        with open(log, "w") as f:
            done = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT)
        if done.returncode:
            raise SystemExit(f"bench/compiled.py: {job} {mode} seed {seed} exited {done.returncode}: see {log}")
        (run / "done").touch()
    return read_rows(run)


def _mean(xs):
    return statistics.fmean(xs) if xs else float("nan")


def _pm(xs):
    return f"{_mean(xs):.3f} ± {statistics.stdev(xs):.3f}" if len(xs) > 1 else f"{_mean(xs):.3f}"


def runs(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    extra = args.extra.split()
    table = ["| job | mode | held-out reward by eval step (mean over seeds) | final reward | mismatch/kl | masked fraction |",
             "| --- | --- | --- | --- | --- | --- |"]
    paired = []
    for job in JOBS:
        finals = {}
        for mode in ("off", "on"):
            curves, kl, masked = [], [], []
            for seed in range(args.seeds):
                rs = run_one(job, mode, seed, out, extra)
                evals = [(r["step"], r["eval/reward"]) for r in rs if "eval/reward" in r]
                steps = [r for r in rs if "loss" in r]
                curves.append(evals)
                kl += [r["mismatch/kl"] for r in steps]
                masked += [r[MASKED] for r in steps if MASKED in r]
            by_step = {s: _mean([dict(c)[s] for c in curves]) for s, _ in curves[0]}
            finals[mode] = [c[-1][1] for c in curves]
            curve = " ".join(f"{s}:{v:.3f}" for s, v in by_step.items())
            table.append(f"| {job} | {'compiled' if mode == 'on' else 'eager'} | {curve} | {_pm(finals[mode])} "
                         f"| {_mean(kl):.2e} | {_mean(masked):.4f} |")
        diffs = [a - b for a, b in zip(finals["on"], finals["off"])]
        paired.append(f"{job}: compiled - eager final reward, paired by seed: {_pm(diffs)} ({', '.join(f'{d:+.3f}' for d in diffs)})")
    text = "\n".join(table + [""] + paired)
    print(text)
    (out / "results.md").write_text(text + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="what", required=True)
    sub.add_parser("logprobs", help="per-token log-prob differences, compiled vs eager, on one step's batch")
    t = sub.add_parser("region", help="ms per micro-batch pass, eager vs the compiled trainer step (and its break)")
    t.add_argument("--repeats", type=int, default=10)
    r = sub.add_parser("runs", help="two jobs compiled and eager over seeds")
    r.add_argument("--seeds", type=int, default=3)
    r.add_argument("--out", default="runs/compiled")
    r.add_argument("--extra", default="", help="more train.py flags for every run (a smoke test: '--steps 2')")
    args = p.parse_args()
    {"logprobs": logprobs, "region": region, "runs": runs}[args.what](args)


if __name__ == "__main__":
    main()
