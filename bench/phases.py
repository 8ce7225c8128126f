"""Where one default RL step spends its time: torch.profiler over a few steps of the main job,
a table per phase and a table of the top operators.

Under the profiler a step runs slower than alone (each operator is recorded): read the shares,
and time whole runs with bench/e2e.py. Each phase is a `record_function` range wrapped around train.py's own functions from outside
(nothing in train.py knows about it), so the same script profiles an older checkout too (every
phase it wraps must show up in the profile, or it stops and names the missing ones): run it
from that checkout's root (`cd old && python /path/to/bench/phases.py`). Start-up, eval and the
first step (warm-up) are left out of the tables.

`--compiled` profiles the job twice, each in a fresh process of its own (this script with `--json`),
eager and with `--compile on`, and prints one table with a column for each. Under --compile on the
trainer's forward, head and loss of a micro-batch run as one compiled region (run/start.py
`trainer_step`): Dynamo ignores the ranges wrapped around the functions inside it, so the compiled
column has the region as one phase and "-" for the phases inside it. Its extra rows: the share of
the step still eager, the self time of the aten operators that run outside every compiled graph
(an operator is compiled when it runs inside Inductor's call of a graph, forward or backward), and
the share that is Inductor's own fused C++ kernels (recorded as ranges of their own: this script
turns Inductor's kernel profiling on under --compile on). The compile happens in the warm-up step;
the table says whether any graph was built in the profiled steps.

    python bench/phases.py                       # 3 profiled steps of the default job, after 1 warm-up
    python bench/phases.py --steps 5 -- --prompts-per-step 16 --group-size 8
    python bench/phases.py --compiled --steps 3  # eager against --compile on, each in its own process
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

sys.path.insert(0, os.getcwd())  # the checkout being profiled

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

import train  # noqa: E402

PHASES = ["rollout", "  generate", "  user code", "pack+validate", "forward", "head", "loss", "backward", "optimizer", "push"]
STEP = "trainer step (compiled: forward+head+loss)"  # --compile on: run/start.py trainer_step's region, as one phase
INSIDE = ("forward", "head", "loss")  # the phases that region holds: Dynamo ignores their ranges there

# What torch 2.13's CPU profile shows of compiled code (observed on profiles of a compiled function and of
# this job): "Torch-Compiled Region: i/j" around Dynamo's frame (the eager code of a graph break and the
# functions behind torch.compiler.disable run inside it too), "CompiledFunction" / "CompiledFunctionBackward"
# around AOTAutograd's runtime wrappers, and inside those "## Call CompiledFxGraph <hash> ##", Inductor's
# call of one compiled graph. An operator is compiled when that call is among its ancestors: the aten ops
# there are the graph's extern kernels (mm, say). Inductor's fused C++ kernels are events only with its
# kernel profiling on (config.cpp.enable_kernel_profile), named "graph_<id>_cpp_fused_..." ("cpp_..."
# without a graph id), each a range around the kernel's own work.
GRAPH_CALL = "## Call CompiledFxGraph"
KERNEL = re.compile(r"(graph_\d+_)?cpp_")


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
    if start is not None and hasattr(start, "compiled"):  # --compile on: the forward's range goes around its graph,
        make = start.compiled  # the trainer step's around its region (forward, head and loss compiled whole)
        outside = {"trainer forward": "forward", "trainer step": STEP}
        start.compiled = lambda fn, region, *a, **k: (_timed(outside[region], make(fn, region, *a, **k))
                                                      if region in outside else make(fn, region, *a, **k))
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

    prof.new_graphs = 0  # --compile on: graphs torch.compile built in the profiled steps (run/runlog.py Graphs)

    def row(self, step, m):  # one metrics row per step: profile from the end of the warm-up step on
        log_row(self, step, m)
        if step > 1:
            prof.new_graphs += m.get("compile/new_graphs", 0)
        if step == 1:
            prof.start()
            prof.t0 = time.perf_counter()
    logger.row = row
    return done


def in_graph(event) -> bool:
    """Whether a profiler FunctionEvent ran inside a compiled graph: Inductor's call of one among its
    ancestors (its cpu_parent chain)."""
    while event is not None:
        if event.name.startswith(GRAPH_CALL):
            return True
        event = event.cpu_parent
    return False


def kind(event) -> str | None:
    """"kernel" (one of Inductor's fused C++ kernels), "compiled" (an aten operator inside a compiled
    graph), "eager" (an aten operator outside every compiled graph), or None (any other range)."""
    if KERNEL.match(event.name):
        return "kernel"
    if event.name.startswith("aten::"):
        return "compiled" if in_graph(event) else "eager"
    return None


def split(events) -> dict[str, float]:
    """Self CPU time in µs of a profile's events (prof.events()) by kind: {"eager", "compiled", "kernel"}."""
    out = {"eager": 0.0, "compiled": 0.0, "kernel": 0.0}
    for e in events:
        if (k := kind(e)) is not None:
            out[k] += e.self_cpu_time_total
    return out


def nested(events, outer: str) -> set[str]:
    """The phases with a range recorded inside a range of the phase `outer`."""
    found = set()
    for e in events:
        if e.name.startswith("phase/"):
            p = e.cpu_parent
            while p is not None and p.name != f"phase/{outer}":
                p = p.cpu_parent
            if p is not None:
                found.add(e.name[6:])
    return found


def results(prof, steps: int, wall_ms: float, wrapped: set[str]) -> dict:
    """Phases: inclusive time of each range; operators: self time; all in ms per step, and the step's wall time."""
    events = prof.key_averages()
    phase = {e.key[6:]: e.cpu_time_total / 1e3 / steps for e in events if e.key.startswith("phase/")}
    # under --compile on Dynamo ignores the ranges of the phases inside the trainer step's region: the
    # region's own range stands for them
    excused = INSIDE if STEP in phase else ()
    if missing := [p.strip() for p in wrapped if p not in phase and p not in excused]:  # a function moved or is no longer called
        raise SystemExit(f"bench/phases.py: no time was recorded for the phase(s) {', '.join(missing)}; "
                         "the functions instrument() wraps are not the ones the step calls")
    ops, calls = defaultdict(float), 0
    for e in events:
        if not e.key.startswith(("phase/", "ProfilerStep")):
            ops[e.key] += e.self_cpu_time_total / 1e3 / steps
            calls += e.count / steps if e.key.startswith("aten::") else 0
    raw = prof.events()
    where = {k: v / 1e3 / steps for k, v in split(raw).items()}
    return {"steps": steps, "wall": wall_ms / steps, "phase": phase, "calls": calls,
            "ops": dict(sorted(ops.items(), key=lambda kv: -kv[1])[:40]),
            "aten": sum(v for k, v in ops.items() if k.startswith("aten::")), **where,
            "inner": sorted(nested(raw, STEP)) if STEP in phase else [],
            "new_graphs": getattr(prof, "new_graphs", 0)}


def _order(phase: dict) -> list[str]:
    """PHASES, with the compiled trainer step (where a run has it) before the phases it holds."""
    names = list(PHASES)
    if STEP in phase:
        names.insert(names.index("forward"), STEP)
    return names


def tables(prof, steps: int, wall_ms: float, wrapped: set[str]) -> str:
    """Phases: inclusive time of each range; operators: self time; shares of the step's wall time."""
    return render(results(prof, steps, wall_ms, wrapped))


def render(r: dict) -> str:
    """One run's tables (results' dict)."""
    phase, total = r["phase"], r["wall"]
    lines = ["| phase | ms per step | share |", "| --- | --- | --- |"]
    for name in _order(phase):
        if name in phase:
            lines.append(f"| {name} | {phase[name]:.0f} | {phase[name] / total:.0%} |")
    lines.append(f"| the step (wall) | {total:.0f} | |")
    # the operators' own time (the kernels and their C++ dispatch): what the step would take with no
    # Python, autograd-engine or profiler time around them, so a floor no eager-mode change goes under
    kernels = r["aten"]
    lines.append(f"| operators alone (aten self time, {r['calls']:,.0f} calls) | {kernels:.0f} | {kernels / total:.0%} |")
    if STEP in phase or r["compiled"] or r["kernel"]:  # a compiled run: what of it still runs eager
        lines.append(f"| still eager (aten self time outside compiled graphs) | {r['eager']:.0f} | {r['eager'] / total:.0%} |")
        lines.append(f"| compiled kernels (Inductor's fused C++ kernels, self time) | {r['kernel']:.0f} | {r['kernel'] / total:.0%} |")
    lines += ["", "| operator (self time) | ms per step | share |", "| --- | --- | --- |"]
    for k, v in list(r["ops"].items())[:12]:
        lines.append(f"| `{k[:60]}` | {v:.0f} | {v / total:.0%} |")
    return "\n".join(lines + _notes(r))


def _notes(r: dict) -> list[str]:
    """The lines a compiled run adds under its tables: graphs built while profiled, ranges Dynamo kept."""
    out = []
    if r["new_graphs"]:
        out.append(f"note: torch.compile built {r['new_graphs']} graph(s) in the profiled steps: their compile time "
                   "is in the table (profile more steps)")
    if r["inner"]:
        out.append(f"note: the phase(s) {', '.join(r['inner'])} recorded time inside the compiled trainer step "
                   "(code that ran eager there), left out of the table")
    return [""] + out if out else []


def compare(e: dict, c: dict) -> str:
    """The eager run's and the compiled run's results as one table: a column pair each."""
    def cell(r, v):
        return ("-", "") if v is None else (f"{v:.0f}", f"{v / r['wall']:.0%}")

    def row(name, ve, vc):
        return "| " + " | ".join([name, *cell(e, ve), *cell(c, vc)]) + " |"

    head = ["| phase | eager ms/step | share | compiled ms/step | share |", "| --- | --- | --- | --- | --- |"]
    lines = list(head)
    compiled, outside = STEP in c["phase"], []
    for name in _order({**e["phase"], **c["phase"]}):
        if name in e["phase"] or name in c["phase"]:
            # held by the compiled region: Dynamo drops its range there, so what it recorded ran outside the
            # region (the pi_old pass through the "trainer forward" region, say), or eager inside it (a note below)
            inner = compiled and name in INSIDE and (name in c["inner"] or name not in c["phase"])
            lines.append(row(name, e["phase"].get(name), None if inner else c["phase"].get(name)))
            if compiled and name in INSIDE and not inner:
                outside.append(name)
    lines.append(f"| the step (wall) | {e['wall']:.0f} | | {c['wall']:.0f} | |")
    lines.append(row(f"operators alone (aten self time; {e['calls']:,.0f} / {c['calls']:,.0f} calls)", e["aten"], c["aten"]))
    lines.append(row("still eager (aten self time outside compiled graphs)", e["eager"], c["eager"]))
    lines.append(row("aten inside compiled graphs (their extern kernels)", e["compiled"], c["compiled"]))
    lines.append(row("compiled kernels (Inductor's fused C++ kernels, self time)", e["kernel"], c["kernel"]))
    lines += ["", "| operator (self time) | eager ms/step | share | compiled ms/step | share |", head[1]]
    top = sorted(set(e["ops"]) | set(c["ops"]), key=lambda k: -max(e["ops"].get(k, 0), c["ops"].get(k, 0)))[:16]
    for k in top:
        lines.append(row(f"`{k[:60]}`", e["ops"].get(k), c["ops"].get(k)))
    graphs = (f"compile/new_graphs in the profiled steps: {c['new_graphs']}"
              + ("" if not c["new_graphs"] else " (their compile time is in the compiled column: profile more steps)"))
    lines += ["", graphs]
    if c["inner"]:
        lines.append(f"note: the phase(s) {', '.join(c['inner'])} recorded time inside the compiled trainer step "
                     "(code that ran eager there), left out of the compiled column")
    if outside:
        lines.append(f"note: {', '.join(outside)} in the compiled column: time outside the compiled trainer step "
                     "(the pi_old pass, say)")
    if not compiled:
        lines.append("note: the compiled run has no trainer step region (this checkout compiles no trainer step, "
                     "or its compile failed: see its output)")
    return "\n".join(lines)


def compile_on(args: list[str]) -> bool:
    """Whether train.py's flags ask for --compile on."""
    return any(a == "--compile=on" or a == "--compile" and nxt == "on" for a, nxt in zip(args, [*args[1:], None]))


def both(steps: int, train_args: list[str]) -> str:
    """--compiled: the job profiled eager and with --compile on, each in a fresh process of its own (the
    compiled one shares no Dynamo or Inductor state with the eager one), its results back as JSON."""
    if any(a.startswith("--compile") for a in train_args):
        raise SystemExit("bench/phases.py --compiled: leave --compile out of train.py's flags; it runs both")
    out = {}
    with tempfile.TemporaryDirectory(prefix="floe-phases-") as tmp:
        for name, extra in (("eager", []), ("compiled", ["--compile", "on"])):
            path = os.path.join(tmp, f"{name}.json")
            cmd = [sys.executable, os.path.abspath(__file__), "--steps", str(steps), "--json", path,
                   "--", *train_args, *extra]
            print(f"bench/phases.py: the {name} run: {' '.join(cmd[1:])}", flush=True)
            if (rc := subprocess.run(cmd).returncode) != 0:
                raise SystemExit(f"bench/phases.py: the {name} run exited with {rc}")
            with open(path) as f:
                out[name] = json.load(f)
    return compare(out["eager"], out["compiled"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3, help="profiled steps, after one warm-up step")
    ap.add_argument("--compiled", action="store_true", help="profile eager and --compile on, each in its own process")
    ap.add_argument("--json", help=argparse.SUPPRESS)  # --compiled's runs: the results to this file, no tables
    ap.add_argument("train_args", nargs="*", help="flags for train.py, after --")
    a = ap.parse_args()
    if a.compiled:
        print(both(a.steps, a.train_args))
        return
    if compile_on(a.train_args):  # Inductor's fused kernels as ranges of their own (set before anything compiles)
        import torch._inductor.config
        torch._inductor.config.cpp.enable_kernel_profile = True
    out = tempfile.mkdtemp(prefix="floe-profile-")
    shutil.rmtree(out)
    prof = profile(activities=[ProfilerActivity.CPU])
    wrapped = instrument(prof)
    train.main(["--steps", str(a.steps + 1), "--eval-every", "0", "--out-dir", out, *a.train_args])
    wall = (time.perf_counter() - prof.t0) * 1e3  # the last checkpoint and the summary too: a few ms
    prof.stop()
    shutil.rmtree(out, ignore_errors=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results(prof, a.steps, wall, wrapped), f)
        return
    print(tables(prof, a.steps, wall, wrapped))


if __name__ == "__main__":
    main()
