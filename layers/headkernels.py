"""The LM head's six Triton kernels, each beside its launcher, and their tiles: what kernels.py's
`triton_head` runs on CUDA. kernels.py holds the head's contract and maths, the plain-torch reference,
and the two passes and two torch.library custom ops (with fake implementations, so the head composes
with torch.compile) that call the launchers here; `setup` picks the tiles and operands.

- forward: `_lse_kernel` runs over token blocks x vocabulary tiles, one tl.dot tile of
  logits at a time, keeping an online max, sum of exp and sum of exp*logit per token
  (log-sum-exp and entropy); the vocabulary is split across programs to fill the GPU and
  the splits are merged in torch. `_support_kernel` takes the label logit and each support
  entry's logit as dot products of gathered rows (N + nnz dots of length H, far cheaper
  than fishing them out of [BLOCK_N, BLOCK_V] tiles) with an online log-sum-exp over the
  row; the renormalization is one torch gather.
- dense backward: per chunk of the vocabulary, `_softmax_grad_kernel` recomputes the logits
  tiles and writes dlogits = -G'_t*p/T (G' = G on non-replayed rows; a replayed row's
  normalizer term is sparse) plus the label and support coefficients that land in the tile
  (the triples are sorted into (vocab tile, token block) buckets, added with a one-hot dot,
  no atomics) as one [N, chunk] tile in the weights' dtype; then `_matmul_kernel` twice:
  d_hidden += dlogits @ W[chunk] into an fp32 [N, H] buffer, and d_W[chunk] = dlogits.T @
  hidden, accumulated over all N tokens in fp32 registers and written once in the weights'
  dtype (no fp32 [V, H] buffer, no second rounding).
- sparse backward: `_sparse_dh_kernel` (one program per token and H block: the label's and
  the row's W rows times their coefficients) and `_sparse_dw_kernel` (one program per vocab
  id and H block: a loop over that id's run of the sorted triples); the sort and the run
  starts (searchsorted) are torch.

Kernel bodies are plain functions here, decorated by `_triton()` on first use, so importing
floe never imports triton. A kernel body resolves `tl` from this module's globals when it
is compiled or interpreted. Triton decides at its own import whether @triton.jit compiles
or interprets (TRITON_INTERPRET=1: numpy, one program at a time, for tensors on any device;
its own tl.* helpers are decorated then too), so the CPU path needs TRITON_INTERPRET=1 set
before triton is first imported; tests/test_triton.py runs its CPU tests in a subprocess.

    python -m pytest -q tests/test_triton.py                         # CPU (interpreter), and each kernel compiled for sm_90
    python -m pytest -q -m gpu tests/test_triton.py                  # CUDA: compiled kernels vs the reference
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import SimpleNamespace

import torch

tl = None  # triton.language, bound by _triton()


@dataclass(frozen=True)
class Tiles:
    """Block sizes and launch settings of the Triton head (powers of two)."""
    n: int  # tokens per logits tile (forward, softmax gradient)
    v: int  # vocabulary ids per logits tile
    h: int  # hidden features per step of a logits tile's dot-product loop
    mm: tuple[int, int, int]  # the backward GEMMs' (M, N, K) tile
    group: int  # GEMM programs walk GROUP row blocks per column sweep, for L2 reuse
    rows: int  # support entries / triples per step of a gather loop or of the one-hot scatter
    row_h: int  # hidden features per gather program
    warps: int  # for the tiled kernels; gather kernels use GATHER_WARPS
    stages: int  # software pipelining depth of the tiled kernels' K loops
    chunk_elements: int  # the dense backward's dlogits tile [N, chunk of V] holds at most this many


# H100/H200 (sm_90): 128x128 tiles with a 64-deep K step, 8 warps, 3 stages (96 KiB of
# shared memory per tiled program); dlogits in bf16 of at most 256 MiB. Not yet measured.
GPU_TILES = Tiles(n=128, v=128, h=64, mm=(128, 128, 64), group=8, rows=16, row_h=256, warps=8, stages=3,
                  chunk_elements=1 << 27)
# the interpreter: tiny tiles, so that tests at tiny shapes still cross every tile, split,
# chunk and mask boundary
INTERPRET_TILES = Tiles(n=8, v=8, h=8, mm=(8, 8, 8), group=2, rows=4, row_h=8, warps=1, stages=1,
                        chunk_elements=96)
GATHER_WARPS = 4

_KERNELS: SimpleNamespace | None = None


def _triton() -> SimpleNamespace:
    """The six kernels, decorated once, and whether Triton interprets them."""
    global tl, _KERNELS, _logits_tile, _gathered_sum
    if _KERNELS is None:
        import triton
        import triton.language
        tl = triton.language
        _logits_tile = triton.jit(_logits_tile_fn)  # each called by two kernels: globals when they compile
        _gathered_sum = triton.jit(_gathered_sum_fn)
        fns = (_lse_kernel, _support_kernel, _softmax_grad_kernel, _matmul_kernel, _sparse_dh_kernel,
               _sparse_dw_kernel)
        _KERNELS = SimpleNamespace(interpret=os.environ.get("TRITON_INTERPRET", "0") == "1",
                                   **{f.__name__[1:]: triton.jit(f) for f in fns})
    return _KERNELS


def setup(hidden: torch.Tensor, weight: torch.Tensor):
    """Kernels, tiles and operands: GPU tiles when compiled; in the interpreter tiny tiles
    and fp32 copies (tl.dot on bf16 is wrong there)."""
    k = _triton()
    assert hidden.is_cuda or k.interpret, \
        "head(impl='triton') on CPU tensors runs in Triton's interpreter: set TRITON_INTERPRET=1 before importing triton"
    if k.interpret:
        return k, INTERPRET_TILES, hidden.float().contiguous(), weight.float().contiguous()
    return k, GPU_TILES, hidden.contiguous(), weight.contiguous()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _precision(x: torch.Tensor) -> str:
    """tl.dot's input precision: exact fp32 products for fp32 (tf32 would cost ~3 digits)."""
    return "ieee" if x.dtype == torch.float32 else "tf32"


def _nonempty(x: torch.Tensor) -> torch.Tensor:
    """A one-element stand-in for an empty tensor passed as a pointer the kernel never reads."""
    return x if x.numel() else x.new_zeros(1)


# ----------------------------------------------------------------------------- forward kernels

def _logits_tile_fn(h_ptr, w_ptr, n, n_ok, v, v_ok, H, stride_h, stride_w, BLOCK_N: tl.constexpr,
                    BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, PREC: tl.constexpr):
    """hidden[n] @ weight[v].T as one fp32 [BLOCK_N, BLOCK_V] tile (masked rows and columns 0),
    over H in BLOCK_H steps: the GEMM the forward and the dense backward both recompute."""
    acc = tl.zeros([BLOCK_N, BLOCK_V], tl.float32)
    for k0 in range(0, H, BLOCK_H):
        k = k0 + tl.arange(0, BLOCK_H)
        k_ok = k < H
        x = tl.load(h_ptr + n[:, None].to(tl.int64) * stride_h + k[None, :],
                    mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + v[None, :].to(tl.int64) * stride_w + k[:, None],
                    mask=k_ok[:, None] & v_ok[None, :], other=0.0)
        acc = tl.dot(x, w, acc, input_precision=PREC)
    return acc


# Fuses the head GEMM with the log-softmax statistics: each program keeps a [BLOCK_N,
# BLOCK_V] fp32 logits tile on chip and folds it into three running values per token, so
# the forward writes 3 floats per token and split instead of N x V logits (4.6 GiB of bf16
# at 16k tokens and V = 152k). Entropy = lse - sum(p*x): with an online max m,
# s = sum exp(x-m) and a = sum exp(x-m)*x, both rescaled by exp(m_old - m_new).
def _lse_kernel(h_ptr, w_ptr, m_ptr, s_ptr, a_ptr, N, V, H, v_per_split, inv_t, stride_h, stride_w,
                BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, PREC: tl.constexpr):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    v_lo = split * v_per_split
    v_hi = tl.minimum(V, v_lo + v_per_split)
    m = tl.full([BLOCK_N], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_N], tl.float32)
    a = tl.zeros([BLOCK_N], tl.float32)
    for v0 in range(v_lo, v_hi, BLOCK_V):
        v = v0 + tl.arange(0, BLOCK_V)
        v_ok = v < v_hi
        logits = _logits_tile(h_ptr, w_ptr, n, n_ok, v, v_ok, H, stride_h, stride_w,
                              BLOCK_N, BLOCK_V, BLOCK_H, PREC) * inv_t  # finite; masked columns are 0 here and -inf below
        m_new = tl.maximum(m, tl.max(tl.where(v_ok[None, :], logits, float("-inf")), 1))
        e = tl.where(v_ok[None, :], tl.exp(logits - m_new[:, None]), 0.0)
        alpha = tl.exp(m - m_new)
        s = s * alpha + tl.sum(e, 1)
        a = a * alpha + tl.sum(e * logits, 1)
        m = m_new
    out = split * N + n
    tl.store(m_ptr + out, m, mask=n_ok)
    tl.store(s_ptr + out, s, mask=n_ok)
    tl.store(a_ptr + out, a, mask=n_ok)


def launch_lse(k, t: Tiles, hidden, weight, inv_t: float, programs: int):
    """-> lse [N], entropy [N] (fp32). The vocabulary is split so that about `programs`
    programs run; the splits' (m, s, a) are merged here."""
    N, H = hidden.shape
    V = weight.shape[0]
    assert weight.shape[1] == H and hidden.dtype == weight.dtype, (hidden.shape, weight.shape, hidden.dtype, weight.dtype)
    assert hidden.stride(1) == 1 and weight.stride(1) == 1
    blocks = _cdiv(N, t.n)
    splits = max(1, min(_cdiv(V, t.v), _cdiv(programs, blocks)))
    per_split = _cdiv(_cdiv(V, splits), t.v) * t.v  # whole tiles; no split is empty
    splits = _cdiv(V, per_split)
    m, s, a = torch.empty(3, splits, N, dtype=torch.float32, device=hidden.device)
    k.lse_kernel[(blocks, splits)](hidden, weight, m, s, a, N, V, H, per_split, inv_t, hidden.stride(0),
                                   weight.stride(0), BLOCK_N=t.n, BLOCK_V=t.v, BLOCK_H=t.h,
                                   PREC=_precision(hidden), num_warps=t.warps, num_stages=t.stages)
    top = m.amax(0)
    scale = torch.exp(m - top)
    total = (s * scale).sum(0)
    lse = top + total.log()
    return lse, lse - (a * scale).sum(0) / total


# One program per token: the label's logit and the row's support logits as dot products of
# gathered W rows with the token's hidden row (fp32 sums), and the row's log-sum-exp
# online, for the replayed renormalization. A token costs (1 + its row) x H reads, not V x H.
def _support_kernel(h_ptr, w_ptr, labels_ptr, ids_ptr, offsets_ptr, label_ptr, raw_ptr, lse_s_ptr, H, inv_t,
                    stride_h, stride_w, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0)
    h_row = h_ptr + t.to(tl.int64) * stride_h
    label = tl.load(labels_ptr + t).to(tl.int64)
    acc = tl.zeros([BLOCK_H], tl.float32)
    for k0 in range(0, H, BLOCK_H):
        k = k0 + tl.arange(0, BLOCK_H)
        x = tl.load(h_row + k, mask=k < H, other=0.0).to(tl.float32)
        acc += x * tl.load(w_ptr + label * stride_w + k, mask=k < H, other=0.0).to(tl.float32)
    tl.store(label_ptr + t, tl.sum(acc, 0) * inv_t)
    start = tl.load(offsets_ptr + t)
    end = tl.load(offsets_ptr + t + 1)
    m = tl.max(tl.full([BLOCK_E], float("-inf"), tl.float32), 0)
    s = tl.sum(tl.zeros([BLOCK_E], tl.float32), 0)
    for e0 in range(start, end, BLOCK_E):
        e = e0 + tl.arange(0, BLOCK_E)
        e_ok = e < end
        v = tl.load(ids_ptr + e, mask=e_ok, other=0).to(tl.int64)
        dots = tl.zeros([BLOCK_E, BLOCK_H], tl.float32)
        for k0 in range(0, H, BLOCK_H):
            k = k0 + tl.arange(0, BLOCK_H)
            x = tl.load(h_row + k, mask=k < H, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + v[:, None] * stride_w + k[None, :], mask=e_ok[:, None] & (k < H)[None, :],
                        other=0.0).to(tl.float32)
            dots += w * x[None, :]
        logit = tl.sum(dots, 1) * inv_t
        tl.store(raw_ptr + e, logit, mask=e_ok)
        logit = tl.where(e_ok, logit, float("-inf"))
        m_new = tl.maximum(m, tl.max(logit, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(logit - m_new), 0)
        m = m_new
    tl.store(lse_s_ptr + t, m + tl.log(tl.maximum(s, 1.0)))  # s >= 1 (the max's own term); -inf if empty


def launch_support(k, t: Tiles, hidden, weight, labels, ids, offsets, inv_t: float):
    """-> label logit [N], raw support logits [nnz], the row's log-sum-exp [N] (fp32)."""
    N, H = hidden.shape
    nnz = ids.shape[0]
    assert labels.shape == (N,) and offsets.shape == (N + 1,) and offsets.dtype == torch.int64, (labels.shape, offsets.shape)
    assert ids.dtype == torch.int32 and ids.dim() == 1 and hidden.stride(1) == 1 and weight.stride(1) == 1
    label, lse_s = torch.empty(2, N, dtype=torch.float32, device=hidden.device)
    raw = torch.empty(max(nnz, 1), dtype=torch.float32, device=hidden.device)
    k.support_kernel[(N,)](hidden, weight, labels, _nonempty(ids), offsets, label, raw, lse_s, H, inv_t,
                           hidden.stride(0), weight.stride(0), BLOCK_E=t.rows, BLOCK_H=t.row_h, num_warps=GATHER_WARPS)
    return label, raw[:nnz], lse_s


# ----------------------------------------------------------------------------- dense backward kernels

# The dense backward's first step, per chunk of the vocabulary: recompute each [BLOCK_N,
# BLOCK_V] logits tile as the forward did, turn it into the softmax gradient
# scale_t * exp(x - lse_t) (scale = -G'_t / T), add the label and support coefficients that
# fall in the tile, and write the sum once in the weights' dtype. The coefficients are
# (token, vocab id, coefficient) triples sorted into (vocab tile, token block) buckets; a
# one-hot dot scatters a bucket into the tile, summing repeated pairs in order: no atomics.
def _softmax_grad_kernel(h_ptr, w_ptr, lse_ptr, scale_ptr, toks_ptr, cols_ptr, coefs_ptr, bucket_ptr, dl_ptr,
                         N, v_lo, v_hi, H, inv_t, stride_h, stride_w, stride_dl,
                         BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
                         BLOCK_R: tl.constexpr, PREC: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_v = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    v = v_lo + pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    n_ok = n < N
    v_ok = v < v_hi
    acc = _logits_tile(h_ptr, w_ptr, n, n_ok, v, v_ok, H, stride_h, stride_w, BLOCK_N, BLOCK_V, BLOCK_H, PREC)
    lse = tl.load(lse_ptr + n, mask=n_ok, other=0.0)
    scale = tl.load(scale_ptr + n, mask=n_ok, other=0.0)
    grad = scale[:, None] * tl.exp(acc * inv_t - lse[:, None])
    bucket = (v_lo // BLOCK_V + pid_v) * tl.num_programs(0) + pid_n
    start = tl.load(bucket_ptr + bucket)
    end = tl.load(bucket_ptr + bucket + 1)
    for r0 in range(start, end, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        r_ok = r < end
        tok = tl.load(toks_ptr + r, mask=r_ok, other=-1)
        col = tl.load(cols_ptr + r, mask=r_ok, other=-1)
        coef = tl.load(coefs_ptr + r, mask=r_ok, other=0.0)
        at_tok = tl.where(n[:, None] == tok[None, :], coef[None, :], 0.0)  # (BLOCK_N, BLOCK_R)
        at_col = tl.where(col[:, None] == v[None, :], 1.0, 0.0)  # (BLOCK_R, BLOCK_V)
        grad += tl.dot(at_tok, at_col, input_precision="ieee")
    tl.store(dl_ptr + n[:, None].to(tl.int64) * stride_dl + (v - v_lo)[None, :],
             grad.to(dl_ptr.dtype.element_ty), mask=n_ok[:, None] & v_ok[None, :])


# C (+)= A @ B with fp32 accumulation over the whole K loop and one cast at the store: the
# dense backward's d_hidden += dlogits @ W[chunk] (into fp32, ACCUMULATE) and d_W[chunk] =
# dlogits.T @ hidden (K = all N tokens, written once in the weights' dtype). Programs sweep
# GROUP_M row blocks per column block so that neighbours share tiles in L2.
def _matmul_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                   ACCUMULATE: tl.constexpr, PREC: tl.constexpr):
    pid = tl.program_id(0)
    blocks_m = tl.cdiv(M, BLOCK_M)
    per_group = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = m < M
    n_ok = n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < K
        a = tl.load(a_ptr + m[:, None].to(tl.int64) * stride_am + k[None, :].to(tl.int64) * stride_ak,
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptr + k[:, None].to(tl.int64) * stride_bk + n[None, :].to(tl.int64) * stride_bn,
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PREC)
    c = c_ptr + m[:, None].to(tl.int64) * stride_cm + n[None, :].to(tl.int64) * stride_cn
    if ACCUMULATE:
        acc += tl.load(c, mask=m_ok[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _launch_matmul(k, t: Tiles, a, b, c, accumulate: bool):
    (M, K), (K2, N) = a.shape, b.shape
    assert K == K2 and c.shape == (M, N) and a.dtype == b.dtype, (a.shape, b.shape, c.shape, a.dtype, b.dtype)
    assert not accumulate or c.dtype == torch.float32, "accumulate into fp32"
    bm, bn, bk = t.mm
    grid = (_cdiv(M, bm) * _cdiv(N, bn),)
    k.matmul_kernel[grid](a, b, c, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0),
                          c.stride(1), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=t.group, ACCUMULATE=accumulate,
                          PREC=_precision(a), num_warps=t.warps, num_stages=t.stages)


def _gemm(k, t: Tiles, a, b, c, accumulate: bool, backward_gemm: str):
    """c = a @ b, or c += a @ b into fp32: by _matmul_kernel (backward_gemm="triton") or by
    torch.mm ("torch": cuBLAS on CUDA, bf16 products summed in fp32 through mm's out_dtype)."""
    if backward_gemm == "triton":
        return _launch_matmul(k, t, a, b, c, accumulate)
    if not accumulate:
        return torch.mm(a, b, out=c)
    c.add_(torch.mm(a, b) if a.dtype == torch.float32 else torch.mm(a, b, out_dtype=torch.float32))


def dense_grads(k, t: Tiles, hidden, weight, lse, scale, toks, cols, coefs, inv_t: float, need_dh: bool,
                 need_dw: bool, backward_gemm: str):
    """d_hidden (fp32) and d_W (weight dtype) of the dense backward, one vocabulary chunk at a
    time: dlogits [N, chunk] in the weights' dtype is the only tile that scales with V."""
    N, H = hidden.shape
    V = weight.shape[0]
    blocks = _cdiv(N, t.n)
    bucket = (cols // t.v) * blocks + toks // t.n  # (vocab tile, token block) of each triple
    bucket, order = torch.sort(bucket, stable=True)
    starts = torch.searchsorted(bucket, torch.arange(_cdiv(V, t.v) * blocks + 1, device=bucket.device))
    toks, cols, coefs = toks[order], cols[order], coefs[order]
    width = min(_cdiv(V, t.v), max(1, t.chunk_elements // (N * t.v))) * t.v  # whole vocab tiles
    dl = torch.empty(N, width, dtype=hidden.dtype, device=hidden.device)
    d_hidden = torch.zeros(N, H, dtype=torch.float32, device=hidden.device) if need_dh else None
    d_weight = torch.empty_like(weight) if need_dw else None
    for v_lo in range(0, V, width):
        v_hi = min(V, v_lo + width)
        part = dl[:, :v_hi - v_lo]
        k.softmax_grad_kernel[(blocks, _cdiv(v_hi - v_lo, t.v))](
            hidden, weight, lse, scale, toks, cols, coefs, starts, part, N, v_lo, v_hi, H, inv_t,
            hidden.stride(0), weight.stride(0), part.stride(0), BLOCK_N=t.n, BLOCK_V=t.v, BLOCK_H=t.h,
            BLOCK_R=t.rows, PREC=_precision(hidden), num_warps=t.warps, num_stages=t.stages)
        if need_dh:
            _gemm(k, t, part, weight[v_lo:v_hi], d_hidden, accumulate=True, backward_gemm=backward_gemm)
        if need_dw:
            _gemm(k, t, part.T, hidden, d_weight[v_lo:v_hi], accumulate=False, backward_gemm=backward_gemm)
    return d_hidden, d_weight


# ----------------------------------------------------------------------------- sparse backward kernels

def _gathered_sum_fn(acc, src_ptr, idx_ptr, coef_ptr, start, end, k, k_ok, stride, BLOCK: tl.constexpr):
    """acc + sum over entries e in [start, end) of coef[e] * src[idx[e], k], in fp32, in entry order."""
    for e0 in range(start, end, BLOCK):
        e = e0 + tl.arange(0, BLOCK)
        e_ok = e < end
        row = tl.load(idx_ptr + e, mask=e_ok, other=0).to(tl.int64)
        coef = tl.load(coef_ptr + e, mask=e_ok, other=0.0)
        x = tl.load(src_ptr + row[:, None] * stride + k[None, :], mask=e_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.sum(x.to(tl.float32) * coef[:, None], 0)
    return acc


# d_hidden[t] = g_label[t]*W[label_t] + sum over row t of coef_e*W[v_e] (coefficients already
# divided by T): one program per token and block of H, gathering only the W rows the token's
# gradient lies on, summed in fp32 in row order.
def _sparse_dh_kernel(w_ptr, labels_ptr, ids_ptr, offsets_ptr, g_label_ptr, coef_ptr, dh_ptr, H, stride_w, stride_dh,
                      BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0)
    k = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    k_ok = k < H
    label = tl.load(labels_ptr + t).to(tl.int64)
    acc = tl.load(g_label_ptr + t) * tl.load(w_ptr + label * stride_w + k, mask=k_ok, other=0.0).to(tl.float32)
    acc = _gathered_sum(acc, w_ptr, ids_ptr, coef_ptr, tl.load(offsets_ptr + t), tl.load(offsets_ptr + t + 1), k, k_ok,
                        stride_w, BLOCK_E)
    tl.store(dh_ptr + t.to(tl.int64) * stride_dh + k, acc.to(dh_ptr.dtype.element_ty), mask=k_ok)


# d_W[v] = sum over the triples of vocab id v of coef*hidden[tok]: the triples are sorted by
# vocab id (stable), so id v's run is [starts[v], starts[v+1]); one program per id and block
# of H sums its run in order and writes the row once (zeros for an id no token touched).
# Deterministic by construction: no float atomics.
def _sparse_dw_kernel(h_ptr, toks_ptr, coefs_ptr, starts_ptr, dw_ptr, H, stride_h, stride_dw,
                      BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    v = tl.program_id(0)
    k = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    k_ok = k < H
    acc = _gathered_sum(tl.zeros([BLOCK_H], tl.float32), h_ptr, toks_ptr, coefs_ptr, tl.load(starts_ptr + v),
                        tl.load(starts_ptr + v + 1), k, k_ok, stride_h, BLOCK_R)
    tl.store(dw_ptr + v.to(tl.int64) * stride_dw + k, acc.to(dw_ptr.dtype.element_ty), mask=k_ok)


def sparse_grads(k, t: Tiles, hidden, weight, labels, ids, offsets, g_label, coef, toks, cols, coefs,
                  need_dh: bool, need_dw: bool):
    """d_hidden and d_W of the sparse backward, in the inputs' dtypes (coefficients / T)."""
    N, H = hidden.shape
    V = weight.shape[0]
    d_hidden = d_weight = None
    if need_dh:
        d_hidden = torch.empty_like(hidden)
        k.sparse_dh_kernel[(N, _cdiv(H, t.row_h))](weight, labels, _nonempty(ids), offsets, g_label, _nonempty(coef),
                                                   d_hidden, H, weight.stride(0), d_hidden.stride(0), BLOCK_E=t.rows,
                                                   BLOCK_H=t.row_h, num_warps=GATHER_WARPS)
    if need_dw:
        cols, order = torch.sort(cols, stable=True)
        starts = torch.searchsorted(cols, torch.arange(V + 1, device=cols.device))
        d_weight = torch.empty_like(weight)
        k.sparse_dw_kernel[(V, _cdiv(H, t.row_h))](hidden, toks[order], coefs[order], starts, d_weight, H,
                                                   hidden.stride(0), d_weight.stride(0), BLOCK_R=t.rows,
                                                   BLOCK_H=t.row_h, num_warps=GATHER_WARPS)
    return d_hidden, d_weight
