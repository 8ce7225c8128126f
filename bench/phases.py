"""Where one default RL step spends its time: torch.profiler over a few steps of the main job,
a table per phase and a table of the top operators.

Under the profiler a step runs slower than alone (each operator is recorded): read the shares,
and time whole runs with bench/e2e.py. Each phase is a `record_function` range wrapped around train.py's own functions from outside
(nothing in train.py knows about it), so the same script profiles an older checkout too (every
phase it wraps must show up in the profile, or it stops and names the missing ones): run it
from that checkout's root (`cd old && python /path/to/bench/phases.py`). Start-up, eval and the
first step (warm-up) are left out of the tables.

    python bench/phases.py                       # 3 profiled steps of the default job, after 1 warm-up
    python bench/phases.py --steps 5 -- --prompts-per-step 16 --group-size 8
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import sys
import tempfile
import time
from collections import defaultdict

sys.path.insert(0, os.getcwd())  # the checkout being profiled

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

import train  # noqa: E402

PHASES = ["rollout", "  generate", "  user code", "pack+validate", "forward", "head", "loss", "backward", "optimizer", "push"]


def _timed(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with record_function(f"phase/{name}"):
            return fn(*args, **kwargs)
    return wrapper


def instrument(prof) -> set[str]:
    """Wrap the step's functions in named ranges (those this checkout has); the step boundary
    advances the profiler. Returns the phases it wrapped, each of which the profile must show."""
    import importlib

    import loss
    from model import Transformer

    def first(*names):  # the first of these modules this checkout has (older checkouts: flat files)
        return next((importlib.import_module(n) for n in names if os.path.exists(n.replace(".", "/") + ".py")), None)

    engines = first("engines.torch_engine", "engines", "rollout")
    usercode = first("tasks.usercode", "usercode")
    wraps = {  # phase: the (owner, attribute) places it wraps, each one this checkout has
        # one of the two runs, by the job; rollout.py holds them (older checkouts: train.py)
        "rollout": [(m, f) for m in (importlib.import_module("rollout"), train) for f in ("rollout_phase", "episode_phase")],
        "  generate": [(engines.TorchEngine, "generate")],  # the engine's calls, inside the rollout
        "  user code": [(usercode, "call_all")] if usercode else [],
        "pack+validate": [(train, "prepare")],
        "head": [(train, "head")],
        "loss": [(loss, "rl_loss"), (train, "rl_loss")],  # train imports it by name
        "forward": [(Transformer, "forward")],
        "backward": [(torch.Tensor, "backward")],
        "optimizer": [(train, "optimizer_step")],
        "push": [(engines.TorchEngine, "load_weights")],
    }
    start = first("run.start", "start")
    if start is not None and hasattr(start, "compiled"):  # --compile on: the forward's range goes around its graph
        make = start.compiled
        start.compiled = lambda fn, region, *a, **k: (_timed("forward", make(fn, region, *a, **k))
                                                      if region == "trainer forward" else make(fn, region, *a, **k))
    done = set()
    for phase, places in wraps.items():
        for owner, attr in places:
            if hasattr(owner, attr):
                setattr(owner, attr, _timed(phase, getattr(owner, attr)))
                done.add(phase)
        if places and phase not in done:  # a function moved: follow it here, or the table loses the phase
            names = ", ".join(f"{getattr(o, '__name__', o)}.{a}" for o, a in places)
            raise SystemExit(f"bench/phases.py: phase {phase.strip()!r}: none of {names} exists in this checkout")
    runlog = first("run.runlog", "runlog")
    logger = runlog.Logger if runlog else getattr(train, "Logger")  # older: in train
    log_row = logger.row

    def row(self, step, m):  # one metrics row per step: profile from the end of the warm-up step on
        log_row(self, step, m)
        if step == 1:
            prof.start()
            prof.t0 = time.perf_counter()
    logger.row = row
    return done


def tables(prof, steps: int, wall_ms: float, wrapped: set[str]) -> str:
    """Phases: inclusive time of each range; operators: self time; shares of the step's wall time."""
    events = prof.key_averages()
    phase = {e.key[6:]: e.cpu_time_total / 1e3 / steps for e in events if e.key.startswith("phase/")}
    if missing := [p.strip() for p in wrapped if p not in phase]:  # a function moved or is no longer called
        raise SystemExit(f"bench/phases.py: no time was recorded for the phase(s) {', '.join(missing)}; "
                         "the functions instrument() wraps are not the ones the step calls")
    total = wall_ms / steps
    lines = ["| phase | ms per step | share |", "| --- | --- | --- |"]
    for name in PHASES:
        if name in phase:
            lines.append(f"| {name} | {phase[name]:.0f} | {phase[name] / total:.0%} |")
    lines.append(f"| the step (wall) | {total:.0f} | |")
    ops, calls = defaultdict(float), 0
    for e in events:
        if not e.key.startswith(("phase/", "ProfilerStep")):
            ops[e.key] += e.self_cpu_time_total / 1e3 / steps
            calls += e.count / steps if e.key.startswith("aten::") else 0
    # the operators' own time (the kernels and their C++ dispatch): what the step would take with no
    # Python, autograd-engine or profiler time around them, so a floor no eager-mode change goes under
    kernels = sum(v for k, v in ops.items() if k.startswith("aten::"))
    lines.append(f"| operators alone (aten self time, {calls:,.0f} calls) | {kernels:.0f} | {kernels / total:.0%} |")
    lines += ["", "| operator (self time) | ms per step | share |", "| --- | --- | --- |"]
    for k, v in sorted(ops.items(), key=lambda kv: -kv[1])[:12]:
        lines.append(f"| `{k[:60]}` | {v:.0f} | {v / total:.0%} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3, help="profiled steps, after one warm-up step")
    ap.add_argument("train_args", nargs="*", help="flags for train.py, after --")
    a = ap.parse_args()
    out = tempfile.mkdtemp(prefix="floe-profile-")
    shutil.rmtree(out)
    prof = profile(activities=[ProfilerActivity.CPU])
    wrapped = instrument(prof)
    train.main(["--steps", str(a.steps + 1), "--eval-every", "0", "--out-dir", out, *a.train_args])
    wall = (time.perf_counter() - prof.t0) * 1e3  # the last checkpoint and the summary too: a few ms
    prof.stop()
    shutil.rmtree(out, ignore_errors=True)
    print(tables(prof, a.steps, wall, wrapped))


if __name__ == "__main__":
    main()
