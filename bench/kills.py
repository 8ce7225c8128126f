"""SIGKILL at random points, then the way on that floe names: the run must end as the
uninterrupted one did, row for row and weight for weight.

    python bench/kills.py --trials 15          # about 1 min a trial on 2 busy cores
    python bench/kills.py --trials 3 --seed 1

Each trial starts `train.py --steps 4 --prompts-per-step 8 --group-size 4 --eval-every 0
--save-every 1` in a fresh directory and SIGKILLs it: even trials after a delay drawn
uniformly over the reference run's wall time (start-up, mid-step, mid-row; a trial that
finishes first shortens the window to its own time, as the load changes), odd ones a random
moment into the write of a random checkpoint (a random time seldom lands in one). Then it
does what floe says: `--resume`, or, when the kill came before the first checkpoint, what
that one line says (the same command again, or delete the directory first).
It compares metrics.jsonl (time/* aside) and final/model.safetensors with an uninterrupted
run's, and prints one row per trial: where the kill landed (rows written, checkpoints whole, a
step_*.tmp torn), the way on, and whether rows and weights are equal. Not collected by pytest
(tests/test_train.py and tests/test_faults.py hold the deterministic kills).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

FLAGS = ["--steps", "4", "--prompts-per-step", "8", "--group-size", "4", "--eval-every", "0", "--save-every", "1"]


def train(out: Path, *more: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *FLAGS, "--out-dir", str(out), *more],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)


def rows(out: Path) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(x).items() if not k.startswith("time/")} for x in lines]


def weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "final" / "model.safetensors"))


def landed(out: Path) -> str:
    """What the kill left: rows written, whole checkpoints, a torn checkpoint (step_*.tmp)."""
    if not out.exists():
        return "nothing written"
    n = len((out / "metrics.jsonl").read_text().splitlines()) if (out / "metrics.jsonl").is_file() else 0
    done = len([p for p in out.glob("step_??????") if (p / "trainer_state" / "state.json").is_file()])
    torn = " + torn ckpt" if any(out.glob("step_*.tmp")) else ""
    return f"{n} rows, {done} ckpts{torn}"


def way_on(out: Path) -> str:
    """Do what floe says after the kill; returns what that was."""
    r = train(out, "--resume")
    if r.returncode == 0:
        return "nothing to do" if "nothing to do" in r.stdout else "--resume"
    said = r.stderr.strip()
    if len(said.splitlines()) != 1:
        raise SystemExit(f"--resume gave more than one line:\n{said}")
    if "delete" in said:
        shutil.rmtree(out)
        how = "deleted, again"
    elif "without --resume" in said or "does not exist" in said:
        how = "again"
    else:
        raise SystemExit(f"--resume: {said}")
    r = train(out)
    if r.returncode:
        raise SystemExit(f"the run again failed: {r.stderr.strip()}")
    return how + (" (started over)" if "starting it over" in r.stdout else "")


def killed_run(out: Path, log: Path, draw: random.Random, span: float, in_write: bool):
    """One run SIGKILLed after a random delay within `span`, or (`in_write`) a random moment into
    the write of a random checkpoint (once its step_N.tmp appears). Returns (exit status, when,
    seconds it ran)."""
    at, target = draw.uniform(0.5, span), out / f"step_{draw.randint(1, 4):06d}.tmp"
    with open(log, "w+") as err:
        t0 = time.monotonic()
        p = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *FLAGS, "--out-dir", str(out)],
                             stdout=subprocess.DEVNULL, stderr=err, cwd=ROOT)
        when = f"{at:.1f} s"
        if in_write:
            while p.poll() is None and not target.exists():
                time.sleep(0.001)
            time.sleep(draw.uniform(0, 0.03))
            when = f"in {target.name[:-4]}'s write"
        try:
            p.wait(timeout=0 if in_write else at)
        except subprocess.TimeoutExpired:
            p.send_signal(signal.SIGKILL)  # this trial's own process, by its pid
            p.wait()
        if p.returncode not in (0, -signal.SIGKILL):
            err.seek(0)
            raise SystemExit(f"{out.name}: train.py exited {p.returncode}:\n{err.read()}")
    return p.returncode, when, time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=15)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    draw = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="floe-kills-") as tmp:
        base = Path(tmp)
        t0 = time.monotonic()
        ref = train(base / "ref")
        span = time.monotonic() - t0
        if ref.returncode:
            raise SystemExit(ref.stderr)
        want_rows, want_w = rows(base / "ref"), weights(base / "ref")
        print(f"reference: {len(want_rows)} rows in {span:.0f} s; each trial kills within that")
        print("| trial | kill | the kill left | way on | rows equal | weights equal |")
        print("| --- | --- | --- | --- | --- | --- |")
        equal = 0
        for i in range(args.trials):
            out = base / f"t{i}"
            code, when, took = killed_run(out, base / f"t{i}.err", draw, span, in_write=i % 2 == 1)
            if code == 0:  # the machine got faster: later kills draw from this run's length
                span = took
            left = "finished first" if code == 0 else landed(out)
            how = way_on(out)
            got_w = weights(out)
            same_rows = rows(out) == want_rows
            same_w = got_w.keys() == want_w.keys() and all(torch.equal(got_w[k], want_w[k]) for k in want_w)
            equal += same_rows and same_w
            print(f"| {i} | {when} | {left} | {how} | {same_rows} | {same_w} |", flush=True)
        print(f"{equal}/{args.trials} trials end as the uninterrupted run")


if __name__ == "__main__":
    main()
