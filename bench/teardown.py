"""The end of a split run (`--inference-gpus 1`, 3 torchrun processes) in a loop, beside busy
processes: how often a launch exits non-zero. Once, on a loaded machine, trainer rank 1 of a
finished split run died with SIGABRT ("terminate called without an active exception", a C++ thread
destroyed while still joinable) as the processes tore down their groups (parallel.leave says why).

Three kinds of launch, from the checkout in the current directory (so an older one can be looped
too: `cd old && python /path/to/bench/teardown.py`):
- train: `train.py --inference-gpus 1 --steps 2` with tiny flags, the launch the test makes;
- bare: setup_distributed, FSDP2 and a full gather of a tiny model on the trainers, one message
  and one broadcast over the link, then the checkout's teardown and exit (parallel.teardown and
  parallel.leave, or what train.py did before them: the trainers destroy the default group, the
  inference rank just returns). Seconds a launch;
- leak: one process, no torchrun: a gloo group kept past exit (as torch's caches keep FSDP2's
  default group), 50 all-reduces, then the checkout's exit (parallel.leave, or a plain return).
  The cheapest reproduction (docs/experiments.md "2026-12-01: split-run exits in a loop").

    python bench/teardown.py                         # 20 train launches, 1 busy process
    python bench/teardown.py --kind bare --runs 100 --busy 2
    python bench/teardown.py --kind all --runs 10

Prints one row per kind: launches, failures (rc != 0), aborts (SIGABRT or "terminate called"),
and the 1-minute load average before and after. Not collected by pytest (bench/).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(os.getcwd())  # the checkout being looped

BARE = """
import sys
sys.path.insert(0, {root!r})
import torch, torch.distributed as dist
import model
try:
    from layers import parallel
except ImportError:  # a checkout from before the folders
    import parallel


def main():
    link = parallel.setup_distributed("cpu", 1)
    if parallel.serving(1):
        msg = link.recv(0)
        link.broadcast(torch.zeros(64))
        link.send([msg[0] + 1], 0)
    else:  # FSDP2 and one gather, as a push does: torch's DTensor caches now hold the default group
        net = parallel.shard(model.Transformer(model.ModelArgs(vocab_size=32, **model.TINY)))
        for v in net.state_dict().values():
            parallel.full(v)
        if link is not None:
            link.send([torch.tensor([1, 2])], 1)
            link.broadcast(torch.ones(64))
            assert link.recv(1)[0].tolist() == [2, 3]
    if hasattr(parallel, "teardown"):
        parallel.teardown(link, 1)
    elif not parallel.serving(1):  # what train.py did before parallel.teardown
        dist.destroy_process_group()


parallel.leave(main) if hasattr(parallel, "leave") else main()
"""

LEAK = """
import ctypes, socket, sys
sys.path.insert(0, {root!r})
from datetime import timedelta
import torch, torch.distributed as dist
try:
    from layers import parallel
except ImportError:  # a checkout from before the folders
    import parallel


def main():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, is_master=True)
    group = dist.ProcessGroupGloo(dist.PrefixStore("leak", store), 0, 1, timedelta(seconds=60))
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))  # held past exit, as torch's caches hold FSDP2's group
    for _ in range(50):
        group.allreduce([torch.ones(1)]).wait()


parallel.leave(main) if hasattr(parallel, "leave") else main()
"""

TINY = ["--engine", "torch", "--steps", "2", "--prompts-per-step", "4", "--group-size", "2",
        "--max-new-tokens", "8", "--eval-every", "0"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(kind: str, tmp: Path, i: int) -> subprocess.CompletedProcess:
    if kind == "leak":  # one process, no torchrun
        script = tmp / "leak.py"
        script.write_text(LEAK.format(root=str(ROOT)))
        return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    if kind == "bare":
        script = tmp / "bare.py"
        script.write_text(BARE.format(root=str(ROOT)))
        args = [str(script)]
    else:
        args = [str(ROOT / "train.py"), "--inference-gpus", "1", *TINY, "--out-dir", str(tmp / f"run{i}")]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "3", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)


def aborted(r: subprocess.CompletedProcess) -> bool:
    text = r.stdout + r.stderr
    return "terminate called" in text or "SIGABRT" in text or "Signal 6" in text


def loop(kind: str, runs: int, log: Path) -> tuple[int, int]:
    fails = aborts = 0
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(runs):
            r = launch(kind, Path(tmp), i)
            if r.returncode != 0:
                fails, aborts = fails + 1, aborts + aborted(r)
                with log.open("a") as f:  # the whole output of each failure, for the record
                    f.write(f"=== {kind} launch {i}: rc {r.returncode}\n{r.stdout}\n{r.stderr}\n")
            print(f"{kind} {i + 1}/{runs}: rc {r.returncode}", flush=True)
    return fails, aborts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kind", choices=["train", "bare", "leak", "all"], default="train")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--busy", type=int, default=1, help="busy-looping processes beside the launches")
    ap.add_argument("--log", default=str(Path(tempfile.gettempdir()) / "teardown-failures.log"),
                    help="where each failure's output goes")
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # a `timeout` still stops the busy processes
    busy = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(a.busy)]
    rows = []
    try:
        for kind in (["train", "bare", "leak"] if a.kind == "all" else [a.kind]):
            before = os.getloadavg()[0]
            fails, aborts = loop(kind, a.runs, Path(a.log))
            rows.append((kind, a.runs, fails, aborts, before, os.getloadavg()[0]))
    finally:
        for p in busy:
            p.kill()
            p.wait()
    print(f"\n{'kind':6} {'busy':>4} {'launches':>8} {'failures':>8} {'aborts':>6} {'load before':>11} {'load after':>10}")
    for kind, n, fails, aborts, before, after in rows:
        print(f"{kind:6} {a.busy:>4} {n:>8} {fails:>8} {aborts:>6} {before:>11.2f} {after:>10.2f}")


if __name__ == "__main__":
    main()
