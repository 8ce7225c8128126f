"""The ragged TokenSupport against a padded [N, K_max] layout, and the head's dense backward
against its sparse one, on the CPU. Prints two tables: bytes, then the head.

    python bench/support.py        # from the repo root; ~1 min on 2 cores

(a) real rollouts: the shipped tiny model (checkpoints/reverse-tiny), TorchEngine in bf16,
    top-p 0.97 with support capture, 32 reverse-text prompts x 8 samples; bytes of the
    ragged support (ids int32 + logq fp32 + offsets int64 + replayed bool) against a padded
    layout (ids int32 + logq fp32 + mask bool per slot, N x K_max slots).
(b) synthetic: 64k rows whose sizes are min(Zipf(a=1.5), 2048) (numpy default_rng(0), a
    discrete power law: most rows hold a few ids, a few hold thousands), ids drawn from
    Qwen3's 151,936-token vocabulary, same comparison.
    The padded bytes come from the shape; that layout is not allocated.
(c) the head, forward + backward, on N=4096 tokens, H=256, V=8192, fp32, temperature 1,
    replayed rows of min(Zipf(1.5), 512) ids (default_rng(1)), random coefficients on logp
    and support_logp. Each backward runs in its own subprocess: time is the median of 3
    runs after one warm-up; peak is the resident-set high-water mark of the first run
    (Linux VmHWM, reset just before it by writing 5 to /proc/self/clear_refs) minus the
    resident set before it (inputs allocated): the extra memory of one forward + backward,
    gradients included, whatever allocates it (tracemalloc would not see torch's tensors).
    At this shape one forward chunk is the whole batch, a [4096, 8192] fp32 tile of 128 MiB,
    and the forward holds about three such tiles (logits, softmax, a product): that is
    most of the sparse path's peak.

Simplifications:
1. Bytes are the tensors' own sizes (numel x element size); allocator slack is ignored.
2. The head runs with torch's default CPU threads; other processes on a shared machine
   add noise to the times, not to the bytes.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from data import TokenSupport  # noqa: E402
from kernels import head  # noqa: E402
from engines.torch_engine import Sampling, TorchEngine  # noqa: E402
from run import hfdir  # noqa: E402
from tasks.task import ReverseText  # noqa: E402
from tasks.textcodec import TextCodec  # noqa: E402

HEAD_SHAPE = dict(N=4096, H=256, V=8192, max_row=512)


def ragged_bytes(sup: TokenSupport) -> int:
    return sum(t.numel() * t.element_size() for t in (sup.ids, sup.logq, sup.offsets, sup.replayed))


def padded_bytes(rows: int, k_max: int) -> int:
    return rows * k_max * (4 + 4 + 1)  # ids int32 + logq fp32 + mask bool per slot


def support_from_lengths(lengths: np.ndarray, V: int, rng: np.random.Generator) -> TokenSupport:
    """Replayed rows of the given sizes: distinct ids per row (the first is the label); logq is
    random, since neither the bytes nor the head read it."""
    nnz = int(lengths.sum())
    start = np.repeat(rng.integers(0, V, len(lengths)), lengths)
    within = np.arange(nnz) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    ids = torch.from_numpy(((start + within) % V).astype(np.int32))  # consecutive ids mod V: distinct in a row
    logq = torch.from_numpy(-rng.exponential(3.0, nnz).astype(np.float32))  # a row's q need not sum to 1 here
    return TokenSupport.from_counts(ids, lengths, logq, torch.ones(len(lengths), dtype=torch.bool))


def rollout_support() -> TokenSupport:
    src = ROOT / "checkpoints" / "reverse-tiny"
    model = hfdir.load(src)
    codec = TextCodec.load(src)
    task = ReverseText(codec)
    prompts = task.sample(32, random.Random(0))
    engine = TorchEngine(model, "bf16", codec.stop_ids, seed=0)
    out = engine.generate([p.ids for p in prompts], 8, Sampling(top_p=0.97, max_new_tokens=24, support=True))
    return TokenSupport.cat([c.support for c in out])


def bytes_row(name: str, sup: TokenSupport) -> list[str]:
    counts = np.diff(sup.host_offsets)
    k_max = int(counts.max())
    rag, pad = ragged_bytes(sup), padded_bytes(sup.num_rows, k_max)
    return [name, f"{sup.num_rows:,}", f"{sup.nnz:,}", f"{counts.mean():.2f}", f"{k_max:,}",
            f"{rag / 2**20:.3f}", f"{pad / 2**20:.3f}", f"1/{pad / rag:.1f}"]


# ----------------------------------------------------------------------------- the head, in a subprocess

def _status(key: str) -> int:
    """VmRSS or VmHWM of this process, in bytes."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def head_child(mode: str) -> dict:
    N, H, V, K = (HEAD_SHAPE[k] for k in ("N", "H", "V", "max_row"))
    rng = np.random.default_rng(1)
    lengths = np.minimum(rng.zipf(1.5, N), K)
    support = support_from_lengths(lengths, V, rng)
    labels = support.ids[torch.from_numpy(support.host_offsets[:-1])].long()  # a replayed row holds its label
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=gen).requires_grad_()
    weight = (torch.randn(V, H, generator=gen) / H**0.5).requires_grad_()
    cl, cs = torch.randn(N, generator=gen), torch.randn(support.nnz, generator=gen)

    def step() -> tuple[float, float]:
        t0 = time.perf_counter()
        logp, _, slp = head(hidden, weight, labels, support, 1.0, sparse=mode == "sparse")
        t1 = time.perf_counter()
        ((logp * cl).sum() + (slp * cs).sum()).backward()
        hidden.grad = weight.grad = None
        return t1 - t0, time.perf_counter() - t1

    before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the high-water mark to the current resident set (Linux >= 4.0)
    first = sum(step())
    peak = _status("VmHWM") - before
    fwd, bwd = np.median(np.array([step() for _ in range(3)]), axis=0) * 1e3
    return {"fwd_ms": fwd, "bwd_ms": bwd, "first_ms": 1e3 * first, "peak": peak,
            "nnz": support.nnz, "k_max": int(lengths.max())}


def head_rows() -> list[list[str]]:
    rows = []
    for mode in ("dense", "sparse"):
        out = subprocess.run([sys.executable, __file__, "--head", mode], capture_output=True, text=True, cwd=ROOT)
        if out.returncode != 0:
            raise RuntimeError(f"head {mode} failed:\n{out.stderr}")
        r = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append([f"head {mode} backward", f"{r['fwd_ms']:,.0f}", f"{r['bwd_ms']:,.0f}",
                     f"{r['fwd_ms'] + r['bwd_ms']:,.0f}", f"{r['first_ms']:,.0f}", f"{r['peak'] / 2**20:,.0f}",
                     f"{r['nnz']:,}", f"{r['k_max']}"])
    return rows


# ----------------------------------------------------------------------------- the table

def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    line = "  ".join("-" * w for w in widths)
    fmt = [("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))) for r in rows]
    return "\n".join(["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths))),
                      line] + fmt)


def main() -> None:
    torch.manual_seed(0)
    t0 = time.perf_counter()
    real = rollout_support()
    lengths = np.minimum(np.random.default_rng(0).zipf(1.5, 65536), 2048)
    synth = support_from_lengths(lengths, 151_936, np.random.default_rng(0))
    print(f"python bench/support.py   (torch {torch.__version__}, {torch.get_num_threads()} threads)")
    print("(a) rollouts: checkpoints/reverse-tiny, TorchEngine bf16, Sampling(top_p=0.97, max_new_tokens=24, "
          "support=True), 32 ReverseText prompts x 8")
    print("(b) synthetic: 65,536 rows of min(Zipf(a=1.5), 2048) ids from V=151,936, numpy default_rng(0)")
    print("bytes: ragged = ids int32 + logq fp32 + offsets int64 + replayed bool; "
          "padded = N x K_max x (ids int32 + logq fp32 + mask bool)")
    print()
    print(table(["support", "rows N", "nnz", "mean row", "K_max", "ragged MiB", "padded MiB", "ragged/padded"],
                [bytes_row("(a) reverse-tiny rollouts", real), bytes_row("(b) synthetic 64k, Zipf 1.5", synth)]))
    V = hfdir.load(ROOT / "checkpoints" / "reverse-tiny").args.vocab_size
    print(f"(a) cannot reach 1/20 on this vocabulary: a ragged row costs at least 8 + 1 + 8 = 17 bytes (offset, "
          f"replayed, one entry) and a padded one at most V x 9 = {V * 9}, so 1/{V * 9 / 17:.1f} at best")
    print()
    print(f"(c) head fwd+bwd on CPU, fp32: N={HEAD_SHAPE['N']}, H={HEAD_SHAPE['H']}, V={HEAD_SHAPE['V']}, "
          f"replayed rows of min(Zipf(1.5), {HEAD_SHAPE['max_row']}) ids (default_rng(1)); one subprocess each;")
    print("    ms = median of 3 after a warm-up (first ms: the warm-up's fwd+bwd); peak = resident high-water mark")
    print("    of the first fwd+bwd (VmHWM, reset via /proc/self/clear_refs) minus the resident set before it")
    print()
    print(table(["variant", "fwd ms", "bwd ms", "fwd+bwd ms", "first ms", "peak MiB", "nnz", "K_max"], head_rows()))
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--head":
        print(json.dumps(head_child(sys.argv[2])))
    else:
        main()
