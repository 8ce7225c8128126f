"""A/B two revisions of floe on the same jobs: is the new one slower anywhere?

Every change to the step (train.py, the engines, the loss, packing, the model, the episodes) is
run through this against the main it started from, alone on the machine, before it lands; its
table goes in the change's note. docs/speed.md says how to read it.

    python bench/ab.py main                       # main against the working tree, every job
    python bench/ab.py 731d758 main               # two revisions
    python bench/ab.py main --jobs default-8x4,episodes-16x8 --rounds 3
    python bench/ab.py HEAD --b-flags "--compile on" --jobs default-8x4 --cold-cache   # one revision, two flag sets

How it measures:
1. Both revisions are laid out in temporary directories (`git worktree add` for a revision; the
   working tree's tracked and untracked files, copied, when REV2 is left out), so nothing either
   one imports comes from the other, and editing the tree while the bench runs changes nothing.
2. A round runs every job once on each revision, alternating (A B, then B A in the next round, so
   a slow drift of the machine's speed falls on both), each run a fresh `python train.py` for
   --steps steps with no eval. A job a revision cannot run (its train.py does not know a flag the
   job needs) is skipped and named.
3. Before each run the bench waits until the machine is quiet: the other processes' CPU time,
   read from /proc/stat over one second, under 2% of the cores. After it, the share of
   /proc/stat's busy time that was not the run's own (os.wait4's rusage) says whether others
   disturbed it (over 5% of the cores); such a run is done again, at most twice, then kept.
4. Per job and phase (metrics.jsonl's time/rollout, time/train, time/step of steps --skip+1 on,
   pooled over rounds; the peak RSS of each run from os.wait4) it prints each revision's median
   and the ratio B/A of the pooled medians with a bootstrap 90% interval (steps resampled within
   each run, runs kept; RSS: runs resampled). A phase passes when the interval's upper end is at
   most 1.02. While a time phase does not pass, that job gets another round, up to --max-rounds;
   then it is reported `slower`.
5. `wall` is the whole process, start-up and compile included (runs resampled); it is shown,
   not judged. --a-flags / --b-flags add train.py flags to one side's runs; --cold-cache gives
   each run an empty Inductor cache (TORCHINDUCTOR_CACHE_DIR), so a compiled run pays its compile.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = ["--loss", "icepop", "--icepop-beta", "2.0"]  # the default job (the README's first command)
EPISODES = ["--task", "jsonl:examples/guess.jsonl", "--env", "guess-letter", "--model", "checkpoints/guess-tiny",
            "--max-new-tokens", "4"]


def shape(p: int, g: int) -> list[str]:
    return ["--prompts-per-step", str(p), "--group-size", str(g)]


# name: (the job's train.py flags, the flags a revision must know to run it)
JOBS = {
    "default-8x4": (DEFAULT + shape(8, 4), []),
    "default-16x8": (DEFAULT + shape(16, 8), []),
    "default-32x16": (DEFAULT + shape(32, 16), []),
    "episodes-16x8": (EPISODES + shape(16, 8), ["--env"]),
    "lora-32x16": (DEFAULT + ["--lora-rank", "8"] + shape(32, 16), ["--lora-rank"]),
    "blocks-16x8": (DEFAULT + ["--activation-checkpointing", "blocks"] + shape(16, 8), ["--activation-checkpointing"]),
}
PHASES = ["time/rollout", "time/train", "time/step"]
BUSY_LIMIT = 0.02  # the other processes' share of the cores that counts as quiet, before a run
DISTURBED = 0.05  # their share during a run that makes it count as disturbed (kernel threads and the
# bench's own bookkeeping stay below it)


# ----------------------------------------------------------------------------- a quiet machine

def cpu_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies over every core since boot, from /proc/stat's first line."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    total = sum(fields[:8])  # guest time is already inside user
    return total - idle, total


def busy_share(seconds: float = 1.0) -> float:
    b0, t0 = cpu_jiffies()
    time.sleep(seconds)
    b1, t1 = cpu_jiffies()
    return (b1 - b0) / max(t1 - t0, 1)


def wait_quiet(max_wait: float) -> bool:
    """Block until the machine is quiet (this process sleeps meanwhile, so what is busy is others);
    False when --max-wait ran out first."""
    start, said = time.monotonic(), 0.0
    while True:
        share = busy_share()
        if share < BUSY_LIMIT:
            return True
        waited = time.monotonic() - start
        if waited > max_wait:
            print(f"  the machine stayed busy ({share:.0%} of the cores) for --max-wait {max_wait:g}s: running anyway")
            return False
        if waited - said >= 60:
            print(f"  waiting for a quiet machine: {share:.0%} of the cores busy", flush=True)
            said = waited


# ----------------------------------------------------------------------------- runs

@dataclass
class Run:
    steps: dict[str, list[float]]  # phase -> its value at each counted step
    rss: float  # peak RSS, bytes
    wall: float  # the whole process, seconds
    disturbed: float  # others' share of the cores during the run


@dataclass
class Rev:
    name: str  # as given
    label: str  # A or B
    root: Path
    flags: set[str] = field(default_factory=set)  # the train.py flags it knows
    extra: list[str] = field(default_factory=list)  # --a-flags or --b-flags
    runs: dict[str, list[Run]] = field(default_factory=dict)


def knows(root: Path) -> set[str]:
    """The flags a checkout's train.py accepts, from its --help."""
    out = subprocess.run([sys.executable, "train.py", "--help"], cwd=root, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise SystemExit(f"bench/ab.py: `python train.py --help` failed in {root}: {out.stderr.strip()[-300:]}")
    return {w.strip(",[]") for w in out.stdout.split() if w.startswith("--")}


def run_once(rev: Rev, job: str, a) -> Run:
    """One `python train.py` of the job in a fresh directory; its counted steps and peak RSS."""
    out = Path(tempfile.mkdtemp(prefix="floe-ab-run-"))
    cmd = [sys.executable, "train.py", *JOBS[job][0], *rev.extra, "--steps", str(a.steps), "--eval-every", "0",
           "--out-dir", str(out / "run")]
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(out / "inductor")} if a.cold_cache else None
    b0, t0 = cpu_jiffies()
    w0 = time.monotonic()
    with open(out / "log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=rev.root, stdout=log, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - w0
    b1, t1 = cpu_jiffies()
    code = os.waitstatus_to_exitcode(status)
    proc.returncode = code
    if code != 0:
        tail = (out / "log").read_text()[-2000:]
        shutil.rmtree(out, ignore_errors=True)
        raise SystemExit(f"bench/ab.py: {job} on {rev.name} exited {code}:\n{tail}")
    ncpu = os.cpu_count() or 1
    busy = (b1 - b0) / max(t1 - t0, 1) * ncpu * wall  # core-seconds the machine was busy
    own = usage.ru_utime + usage.ru_stime
    rows = [json.loads(x) for x in (out / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rows = [r for r in rows if r.get("step", 0) > a.skip and "time/step" in r]
    shutil.rmtree(out, ignore_errors=True)
    return Run({p: [r[p] for r in rows] for p in PHASES}, usage.ru_maxrss * 1024.0, wall,
               max(0.0, busy - own) / (ncpu * wall))


def measured(rev: Rev, job: str, a) -> Run:
    """A run on a quiet machine, done again (at most twice) when others disturbed it."""
    for attempt in range(3):
        wait_quiet(a.max_wait)
        r = run_once(rev, job, a)
        if r.disturbed < DISTURBED:
            return r
        print(f"  {job} on {rev.name}: others used {r.disturbed:.0%} of the cores during the run"
              + ("; again" if attempt < 2 else "; kept, marked"), flush=True)
    return r


# ----------------------------------------------------------------------------- statistics

def pooled(runs: list[Run], phase: str) -> list[float]:
    return [v for r in runs for v in r.steps[phase]]


def interval(a: list[Run], b: list[Run], phase: str, rng: random.Random, n: int = 2000) -> tuple[float, float, float]:
    """median(B) / median(A), pooled over runs, and its bootstrap 90% interval."""
    def med(runs, resample):
        if phase in ("rss", "wall"):
            vals = [getattr(r, phase) for r in runs]
            return statistics.median([rng.choice(vals) for _ in vals] if resample else vals)
        vals = [v for r in runs for v in ([rng.choice(r.steps[phase]) for _ in r.steps[phase]] if resample
                                          else r.steps[phase])]
        return statistics.median(vals)
    ratio = med(b, False) / med(a, False)
    boots = sorted(med(b, True) / med(a, True) for _ in range(n))
    return ratio, boots[int(0.05 * n)], boots[int(0.95 * n) - 1]


def verdict(hi: float) -> str:
    """A phase passes when B is at most 2% slower at the interval's upper end; "faster" when even
    that end is below 1; "slower" otherwise (after the extra rounds, a phase that cannot be shown
    within 2% counts as slower)."""
    return "slower" if hi > 1.02 else "faster" if hi < 1.0 else "pass"


def table(a: Rev, b: Rev, jobs: list[str], rng: random.Random) -> tuple[str, dict[str, list[str]]]:
    lines = [f"| job | phase | A {a.name} | B {b.name} | B/A | 90% interval | each round's B/A | verdict |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    failing: dict[str, list[str]] = {}
    for job in jobs:
        ra, rb = a.runs[job], b.runs[job]
        for phase in PHASES + ["wall", "rss"]:
            ratio, lo, hi = interval(ra, rb, phase, rng)
            v = verdict(hi)
            if phase == "rss":
                ma, mb = (f"{statistics.median(r.rss for r in rs) / 2**20:,.0f} MiB" for rs in (ra, rb))
            elif phase == "wall":
                ma, mb = (f"{statistics.median(r.wall for r in rs):.1f} s" for rs in (ra, rb))
                v = "(shown)"
            else:
                ma, mb = (f"{statistics.median(pooled(rs, phase)):.3f} s" for rs in (ra, rb))
                if v not in ("pass", "faster"):
                    failing.setdefault(job, []).append(phase)
            name = "peak RSS" if phase == "rss" else phase
            rounds = [getattr(y, phase) / getattr(x, phase) if phase in ("rss", "wall")
                      else statistics.median(y.steps[phase]) / statistics.median(x.steps[phase])
                      for x, y in zip(ra, rb)]  # the machine's drift shows here: a round's A and B ran back to back
            lines.append(f"| {job} ({len(ra)}+{len(rb)} runs) | {name} | {ma} | {mb} | {ratio:.3f} | "
                         f"{lo:.3f}-{hi:.3f} | {min(rounds):.2f}-{max(rounds):.2f} | {v} |")
    return "\n".join(lines), failing


# ----------------------------------------------------------------------------- checkouts

def checkout(spec: str | None, label: str, tmp: Path) -> Rev:
    """A revision in a temporary worktree, or (None) a copy of the working tree as it is now."""
    dest = tmp / label
    if spec is None:
        files = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT,
                               capture_output=True, check=True).stdout.decode().split("\0")
        for f in filter(None, files):
            if (ROOT / f).is_file():
                (dest / f).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / f, dest / f)
        return Rev("the working tree", label, dest)
    res = subprocess.run(["git", "worktree", "add", "--detach", "-q", str(dest), spec], cwd=ROOT,
                         capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"bench/ab.py: cannot check out {spec!r}: {res.stderr.strip()}")
    return Rev(spec, label, dest)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rev", help="A: the revision to compare against (e.g. main)")
    ap.add_argument("rev2", nargs="?", help="B (default: the working tree as it is now)")
    ap.add_argument("--jobs", default=",".join(JOBS), help=f"comma-separated, from {', '.join(JOBS)}")
    ap.add_argument("--steps", type=int, default=8, help="steps a run")
    ap.add_argument("--skip", type=int, default=2, help="warm-up steps left out of the medians")
    ap.add_argument("--rounds", type=int, default=2, help="rounds every job gets")
    ap.add_argument("--max-rounds", type=int, default=6, help="rounds a job whose phase does not pass may get")
    ap.add_argument("--max-wait", type=float, default=600, help="seconds to wait for a quiet machine before a run")
    ap.add_argument("--seed", type=int, default=0, help="the bootstrap's seed")
    ap.add_argument("--a-flags", default="", help="train.py flags added to A's runs (e.g. \"--compile off\")")
    ap.add_argument("--b-flags", default="", help="train.py flags added to B's runs")
    ap.add_argument("--cold-cache", action="store_true", help="each run with an empty Inductor cache")
    a = ap.parse_args()
    jobs = a.jobs.split(",")
    if unknown := [j for j in jobs if j not in JOBS]:
        ap.error(f"--jobs: unknown {', '.join(unknown)} (known: {', '.join(JOBS)})")
    if a.steps <= a.skip:
        ap.error(f"--steps {a.steps} leaves no step after --skip {a.skip}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill still removes the worktrees (finally)
    tmp = Path(tempfile.mkdtemp(prefix="floe-ab-"))
    revs: list[Rev] = []
    try:
        revs = [checkout(a.rev, "A", tmp), checkout(a.rev2, "B", tmp)]
        for r, extra in zip(revs, (a.a_flags, a.b_flags)):
            r.flags, r.extra = knows(r.root), shlex.split(extra)
            if extra:
                r.name += f" {extra}"
        runnable = []
        for job in jobs:
            missing = {r.name: [f for f in JOBS[job][1] if f not in r.flags] for r in revs}
            if any(missing.values()):
                why = "; ".join(f"{n} has no {' '.join(m)}" for n, m in missing.items() if m)
                print(f"skipped {job}: {why}")
            else:
                runnable.append(job)
        print(f"A = {revs[0].name}, B = {revs[1].name}; jobs {', '.join(runnable)}; {a.steps} steps a run, "
              f"medians of steps {a.skip + 1}-{a.steps}; {os.cpu_count()} cores", flush=True)
        todo, rounds = list(runnable), 0
        while todo:
            rounds += 1
            for job in todo:
                order = revs if rounds % 2 else revs[::-1]
                for r in order:
                    run = measured(r, job, a)
                    r.runs.setdefault(job, []).append(run)
                    print(f"  round {rounds} {job} {r.label}: step {statistics.median(run.steps['time/step']):.3f} s"
                          f", peak {run.rss / 2**20:,.0f} MiB", flush=True)
            if rounds < a.rounds:
                continue
            _, failing = table(revs[0], revs[1], runnable, random.Random(a.seed))
            todo = [j for j in failing if rounds < a.max_rounds]
        text, failing = table(revs[0], revs[1], runnable, random.Random(a.seed))
        print()
        print(text)
        if failing:
            print("\nnot passing: " + "; ".join(f"{j} {', '.join(p)}" for j, p in failing.items()))
    finally:
        for r in revs:
            if (r.root / ".git").exists():  # a worktree, not a copy
                subprocess.run(["git", "worktree", "remove", "--force", str(r.root)], cwd=ROOT, capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
        subprocess.run(["git", "worktree", "prune"], cwd=ROOT, capture_output=True)


if __name__ == "__main__":
    main()
