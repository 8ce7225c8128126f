"""The fused LM head, forward + backward, against two baselines: time and peak memory.

    python bench/head.py       # from the repo root; CUDA: ~1 min on one H200; CPU: ~1.5 min on 2 cores

Rows (the loss on top is a random linear combination of the outputs, like the RL loss's):
- "no support": head(hidden, W, labels) - logp and entropy, dense backward;
- "ragged, dense backward" / "ragged, sparse backward": head with a TokenSupport of replayed
  rows whose sizes are min(Zipf(a=1.5), max_row) (numpy default_rng(0); most rows hold a few
  ids, a few hold max_row; ids consecutive mod V from a random start, the label first), as
  in bench/support.py; logp, entropy and support_logp;
- "linear_cross_entropy": torch.nn.functional.linear_cross_entropy(reduction="none"), chunked:
  LinearCrossEntropyOptions() on CUDA (torch's tuned "auto"); on the CPU batch_chunk_size =
  kernels.TILE_ELEMENTS // V tokens, the reference's own chunk ("auto" was many times slower
  at the CPU shape here, varying from run to run); logp only; "n/a" where torch lacks it (< 2.13);
- "materialized logits": hidden @ W.T, then float().log_softmax(-1) and a gather; logp only;
- CUDA only, "..., torch.mm bwd GEMMs": the same two dense rows with head(...,
  backward_gemm="torch") (the backward's two GEMMs by cuBLAS instead of floe's Triton matmul);
- "4 GEMMs (torch.mm)": the dense path's four matmuls alone (forward logits, the backward's
  recompute, d_hidden, d_W) as torch.mm in the inputs' dtype (cuBLAS on CUDA), no softmax,
  no autograd: the dense path at the GEMM library's speed, the yardstick for its kernels.
CUDA: N = 16,384 and 65,536 tokens, H = 2048, V = 151,936 (Qwen3), bf16, the Triton kernels;
the time is the median of 5 fwd+bwd after 2 warm-ups (CUDA events around each step); peak is
torch.cuda.max_memory_allocated() over one fwd+bwd minus the memory allocated before it
(inputs, support and coefficients): the extra memory, gradients included. An out-of-memory
row prints "OOM".
CPU: a shape scaled down (named in the output), fp32, the plain-torch reference for floe's
rows; each row in its own subprocess: the time is the median of 3 after a warm-up; peak is
the resident-set high-water mark of the first fwd+bwd (VmHWM, reset just before it through
/proc/self/clear_refs) minus the resident set before it - whatever allocates it (tracemalloc
does not see torch's tensors).

Simplifications:
1. Each row is timed alone on an idle device; CUDA rows run in one process, one after the
   other, with the caching allocator emptied between them.
2. The baselines compute logp only; floe's rows also give entropy (and support_logp).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from data import TokenSupport  # noqa: E402
from kernels import TILE_ELEMENTS, head  # noqa: E402

CUDA_SHAPE = dict(Ns=(16_384, 65_536), H=2048, V=151_936, max_row=2048, dtype=torch.bfloat16)
CPU_SHAPE = dict(Ns=(1024, 4096), H=256, V=8192, max_row=256, dtype=torch.float32)
ROWS = ("no support", "ragged, dense backward", "ragged, sparse backward", "linear_cross_entropy",
        "materialized logits", "4 GEMMs (torch.mm)")
CUDA_ROWS = ROWS[:2] + tuple(f"{r}, torch.mm bwd GEMMs" for r in ROWS[:2]) + ROWS[2:]
TORCH_GEMMS = ", torch.mm bwd GEMMs"
HAS_LCE = hasattr(F, "linear_cross_entropy") and hasattr(torch.nn, "LinearCrossEntropyOptions")


def problem(N: int, H: int, V: int, max_row: int, dtype: torch.dtype, device: str) -> dict:
    """Inputs of every row: hidden, W, labels, the Zipf-sized replayed support, coefficients."""
    rng = np.random.default_rng(0)
    lengths = np.minimum(rng.zipf(1.5, N), max_row)
    nnz = int(lengths.sum())
    first = np.cumsum(lengths) - lengths  # each row's first entry
    start = np.repeat(rng.integers(0, V, N), lengths)
    ids = ((start + np.arange(nnz) - np.repeat(first, lengths)) % V).astype(np.int32)  # distinct in a row
    support = TokenSupport.from_counts(torch.from_numpy(ids), lengths, torch.zeros(nnz),
                                       torch.ones(N, dtype=torch.bool)).to(device)
    gen = torch.Generator(device).manual_seed(0)  # drawn on the device: W has 311M entries
    return dict(hidden=torch.randn(N, H, generator=gen, device=device).to(dtype).requires_grad_(),
                weight=(torch.randn(V, H, generator=gen, device=device) / H**0.5).to(dtype).requires_grad_(),
                labels=torch.from_numpy(ids[first]).long().to(device),  # a replayed row holds its label
                support=support, cl=torch.randn(N, generator=gen, device=device),
                cs=torch.randn(nnz, generator=gen, device=device))


def step(row: str, p: dict, impl: str) -> None:
    """One forward + backward of a row; the gradients are dropped."""
    hidden, weight, labels, cl = p["hidden"], p["weight"], p["labels"], p["cl"]
    gemm = "torch" if row.endswith(TORCH_GEMMS) else "triton"
    row = row.removesuffix(TORCH_GEMMS)
    if row == "no support":
        logp, _, _ = head(hidden, weight, labels, None, impl=impl, backward_gemm=gemm)
        loss = (logp * cl).sum()
    elif row.startswith("ragged"):
        logp, _, slp = head(hidden, weight, labels, p["support"], sparse=row.endswith("sparse backward"), impl=impl,
                            backward_gemm=gemm)
        loss = (logp * cl).sum() + (slp * p["cs"]).sum()
    elif row == "linear_cross_entropy":
        chunk = {} if hidden.is_cuda else {"batch_chunk_size": TILE_ELEMENTS // weight.shape[0]}
        nll = F.linear_cross_entropy(hidden, weight, labels, reduction="none",
                                     options=torch.nn.LinearCrossEntropyOptions(**chunk))
        loss = -(nll.float() * cl).sum()
    elif row == "materialized logits":
        logp = (hidden @ weight.T).float().log_softmax(-1).gather(1, labels[:, None])[:, 0]
        loss = (logp * cl).sum()
    else:  # the four GEMMs: the logits stand in for dlogits
        with torch.no_grad():
            hidden @ weight.T
            logits = hidden @ weight.T
            logits @ weight, logits.T @ hidden
        return
    torch.autograd.grad(loss, (hidden, weight))


# ----------------------------------------------------------------------------- CUDA: in this process

def cuda_row(row: str, N: int) -> tuple[str, str]:
    """(ms, peak GiB) of one row on the GPU, as strings."""
    if row == "linear_cross_entropy" and not HAS_LCE:
        return "n/a", "n/a"
    shape = {k: v for k, v in CUDA_SHAPE.items() if k != "Ns"}
    p = problem(N, device="cuda", **shape)
    try:
        for _ in range(2):
            step(row, p, "triton")
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step(row, p, "triton")
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        peak = torch.cuda.max_memory_allocated() - before
        return f"{np.median(times):,.1f}", f"{peak / 2**30:.2f}"
    except torch.cuda.OutOfMemoryError:
        return "OOM", "OOM"
    finally:
        del p
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- CPU: a subprocess per row

def _status(key: str) -> int:
    """VmRSS or VmHWM of this process, in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def cpu_child(row: str, N: int) -> dict:
    if row == "linear_cross_entropy" and not HAS_LCE:
        return {"ms": "n/a", "peak": "n/a"}
    shape = {k: v for k, v in CPU_SHAPE.items() if k != "Ns"}
    p = problem(N, device="cpu", **shape)
    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the high-water mark to the current resident set (Linux >= 4.0)
    step(row, p, "torch")  # the warm-up, measured for memory
    peak = _status("VmHWM") - before
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        step(row, p, "torch")
        times.append(time.perf_counter() - t0)
    return {"ms": f"{1e3 * np.median(times):,.0f}", "peak": f"{peak / 2**30:.3f}"}


def cpu_row(row: str, N: int) -> tuple[str, str]:
    out = subprocess.run([sys.executable, __file__, "--child", row, str(N)], capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"{row} at N={N} failed:\n{out.stderr[-3000:]}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    return r["ms"], r["peak"]


# ----------------------------------------------------------------------------- the table

def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    fmt = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    return "\n".join([fmt(header), "  ".join("-" * w for w in widths)] + [fmt(r) for r in rows])


def main() -> None:
    t0 = time.perf_counter()
    cuda = torch.cuda.is_available()
    shape, measure = (CUDA_SHAPE, cuda_row) if cuda else (CPU_SHAPE, cpu_row)
    H, V, K = shape["H"], shape["V"], shape["max_row"]
    device = torch.cuda.get_device_name(0) if cuda else f"CPU, {torch.get_num_threads()} threads"
    print(f"python bench/head.py   (torch {torch.__version__}, {device})")
    print(f"H={H:,}, V={V:,}, {str(shape['dtype']).removeprefix('torch.')}; ragged rows: replayed, "
          f"min(Zipf(1.5), {K:,}) ids each (default_rng(0))")
    if cuda:
        print("floe rows: the Triton kernels. ms: median of 5 fwd+bwd after 2 warm-ups; peak: max_memory_allocated "
              "over the fwd+bwd minus the memory before it (inputs)")
    else:
        print("scaled down for the CPU (the CUDA run: N=16,384/65,536, H=2,048, V=151,936, bf16). floe rows: the "
              "plain-torch reference (Triton rows only on CUDA).")
        print("ms: median of 3 after a warm-up, one subprocess per cell; peak: resident high-water mark of the "
              "warm-up fwd+bwd (VmHWM, reset via /proc/self/clear_refs) minus the resident set before it")
        print(f"linear_cross_entropy: batch_chunk_size={TILE_ELEMENTS // V:,} (the reference's chunk; torch's "
              "'auto' is 4-7 s a step at this shape)")
    for N in shape["Ns"]:
        lengths = np.minimum(np.random.default_rng(0).zipf(1.5, N), K)
        print(f"N={N:,}: support nnz={int(lengths.sum()):,}, mean row {lengths.mean():.1f}, K_max={int(lengths.max()):,}")
    print()
    header = ["variant"] + [c for N in shape["Ns"] for c in (f"N={N:,} ms", "peak GiB")]
    rows = [[row] + [c for N in shape["Ns"] for c in measure(row, N)] for row in (CUDA_ROWS if cuda else ROWS)]
    print(table(header, rows))
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        print(json.dumps(cpu_child(sys.argv[2], int(sys.argv[3]))))
    else:
        main()
