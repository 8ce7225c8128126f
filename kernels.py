"""The LM head fused with the log-softmax: per-token label log-prob, entropy and support
log-probs, without ever holding [N, V] logits. One contract, two implementations, both here:
the contract, its maths and the plain-torch chunked reference (the CPU path and the tests'
oracle) first, then the six Triton kernels that run it on CUDA (`triton_head`).

    head(hidden[N,H], weight[V,H], labels[N], support | None, temperature, sparse=False, impl="auto")
        -> logp[N] fp32, entropy[N] fp32 (no grad), support_logp[nnz] fp32

logp is log p(label) at the temperature (logits = hidden @ weight.T / T); for a replayed
support row (sampling truncated by top-p/top-k) it is renormalized over that row's
support, as the sampler drew it. support_logp is log p(v) for each support entry,
renormalized the same way.

Which implementation (`impl`): "auto" (the default) takes the Triton kernels
for CUDA tensors when triton imports, else the reference; "torch" always takes the reference
(the oracle in tests); "triton" always takes the kernels - on CPU tensors only in Triton's
interpreter (numpy, one program at a time: tests at tiny shapes), which needs
TRITON_INTERPRET=1 set before triton is first imported. triton is imported on first use
(`_triton()`), so floe imports and runs without it (requirements.txt does not list it).

Two backwards, one forward:
- dense (default): the forward keeps only per-token scalars and the backward recomputes the
  logits and takes the full softmax gradient. Always correct. (The reference keeps the
  logits instead when [N, V] is small, KEEP_ELEMENTS: a tiny vocabulary's are cheaper to keep.)
- sparse (`sparse=True`): the gradient of token t with respect to its logits is
      g_logp[t]*e_label + sum_e g_slp[e]*e_{v_e} - G_t * dnorm_t,   G_t = g_logp[t] + sum_e g_slp[e]
  where dnorm_t is p_S (the row's renormalized softmax) on a replayed row and the full
  softmax p on any other row. On a replayed row every term lies on the label and the row.
  On another row the last term is dense, and the sparse backward DROPS it: it is exact
  only when G_t = 0, which holds for reinforce with score centering and no KL under K
  draws (w = 1, u = 1/K, so -A + K*A/K = 0), and trivially on rows with no incoming
  gradient (prompt, padding). Anything else (icepop/ipo/tis weights under draws, a KL, an
  empty row on a loss token) needs the dense backward; `loss.sparse_ok` says which from the
  config, without reading the device.
  The forward saves hidden, weight, labels, the support and its own support_logp (p_S =
  exp of it on a replayed row; nnz floats, the size of the support's logq) - nothing of
  size V per token. The backward forms (token, vocab id, coefficient) triples for labels
  and support entries, gets d_hidden[t] = sum coef*W[v]/T from gathered W rows and CSR
  segment sums, and d_W[v] = sum coef*hidden[t]/T by sorting the triples by vocab id
  (stable) and segment-summing each id's run: no float atomics, so two runs are
  bit-identical. Reference and kernels share this contract.

Simplifications:
1. The reference is the CPU path and the oracle. Its peak extra memory is a few [chunk, V]
   fp32 tiles (the forward, and the dense backward's recompute under activation
   checkpointing); the sparse backward needs only gathered [rows, H] fp32 tiles and one
   [V, H] partial of d_W per block of triples. It computes logits in the weights' dtype
   and upcasts them before the softmax, so in bf16 it rounds each logit to bf16; the
   kernels keep fp32 logits (fp32 accumulation of bf16 products) and are the more exact.
2. The sparse backward reads p_S from the saved support_logp rather than recomputing each
   entry's logit: it matches the forward bit for bit and skips an [nnz, H] gather.
   Gradients are computed in fp32 and cast back to the inputs' dtypes.
3. `head` cannot check G_t = 0 without a host sync; tests/test_lm_head.py checks it for
   the configurations `loss.sparse_ok` admits.
4. The kernels use fixed tile sizes (`GPU_TILES`, chosen for an H100/H200, sm_90: tl.dot wants
   >= 16 per dim), no autotuning: the interpreter accepts exactly one config, and one set keeps
   them deterministic and their compile time short. The dense backward's dlogits tile is
   stored in the weights' dtype (bf16 on GPUs, as in other fused cross-entropy kernels) before
   the two GEMMs; the sums around it are fp32.
5. The dense backward's two GEMMs per vocabulary chunk run as `_matmul_kernel`
   (backward_gemm="triton", the default) or as torch.mm ("torch": cuBLAS on CUDA, bf16
   products summed in fp32 through mm's out_dtype). bench/head.py times both on a GPU;
   whichever wins there should become the default.
6. In the interpreter the kernels see fp32 copies of hidden and weight: tl.dot on bf16 is
   wrong there (the interpreter holds bf16 as raw uint16 bits and multiplies those, triton
   issue #11584). fp32 on a GPU uses exact ("ieee") dot products, not tf32.

    python -m pytest -q tests/test_lm_head.py tests/test_triton.py   # CPU (interpreter), ~1 min
    python -m pytest -q -m gpu tests/test_triton.py                  # CUDA: compiled kernels vs the reference
    python bench/head.py       # fwd+bwd ms and peak memory: the kernels vs baselines (CPU: the reference)
    python bench/support.py    # ragged vs padded bytes, dense vs sparse backward
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

from data import TokenSupport, entry_rows

TILE_ELEMENTS = 1 << 25  # a [chunk, V] fp32 tile of at most 128 MiB
KEEP_ELEMENTS = 1 << 20  # the reference keeps [N, V] logits for the backward up to 4 MiB, else recomputes


def _row_logsumexp(x: torch.Tensor, rows: torch.Tensor, n: int) -> torch.Tensor:
    """logsumexp of x over each row's entries -> [n]; -inf for an empty row."""
    m = torch.full((n,), float("-inf"), device=x.device).scatter_reduce(0, rows, x, "amax", include_self=True)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    s = torch.zeros(n, device=x.device).index_add(0, rows, (x - m_safe[rows]).exp())
    return m_safe + s.log()


def _chunk(hidden, weight, labels, ids, offsets, replayed, temperature: float, nnz: int):
    logits = (hidden @ weight.T).float() / temperature  # (C, V)
    lse = torch.logsumexp(logits, dim=-1)  # (C,)
    label_logit = logits.gather(1, labels[:, None])[:, 0]
    with torch.no_grad():
        p = torch.softmax(logits, dim=-1)
        entropy = lse - (p * logits).sum(-1)
    if nnz == 0:
        return label_logit - lse, entropy, logits.new_zeros(0)
    rows = entry_rows(offsets, nnz)
    sup_logit = logits[rows, ids.long()]  # (nnz,)
    lse_s = _row_logsumexp(sup_logit, rows, labels.shape[0])
    norm = torch.where(replayed, lse_s, lse)  # replayed rows: renormalize over the support
    return label_logit - norm, entropy, sup_logit - norm[rows]


def _chunks(hidden, weight, labels, support: TokenSupport | None, temperature: float, chunk: int, fn):
    """Run fn (_chunk or a checkpointed _chunk) over token chunks; concatenate its outputs."""
    N = hidden.shape[0]
    outs = []
    for c0 in range(0, N, chunk):
        c1 = min(N, c0 + chunk)
        sup = TokenSupport.empty(c1 - c0, hidden.device) if support is None else support.slice(c0, c1)
        outs.append(fn(hidden[c0:c1], weight, labels[c0:c1], sup.ids, sup.offsets, sup.replayed,
                       temperature, sup.nnz))
    return [torch.cat(o) for o in zip(*outs)]


def head(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
         support: TokenSupport | None = None, temperature: float = 1.0, chunk: int | None = None,
         sparse: bool = False, impl: str = "auto", backward_gemm: str = "triton"):
    """logp [N], entropy [N] (no grad), support_logp [nnz]; see the module docstring.
    sparse=True takes the sparse backward: exact only where `loss.sparse_ok` holds.
    impl: "auto" (Triton for CUDA tensors when triton imports), "triton" or "torch";
    chunk (tokens per chunk) applies to the reference only, backward_gemm to the kernels
    only: the dense backward's two GEMMs by floe's Triton matmul ("triton") or by torch.mm
    ("torch", cuBLAS on CUDA)."""
    N, V = hidden.shape[0], weight.shape[0]
    assert hidden.shape[1] == weight.shape[1] and labels.shape == (N,), (hidden.shape, weight.shape, labels.shape)
    assert support is None or support.num_rows == N, "support needs one row per token"
    assert impl in ("auto", "triton", "torch"), impl
    if impl == "triton" or (impl == "auto" and hidden.is_cuda and triton_available()):
        return triton_head(hidden, weight, labels, support, temperature, sparse, backward_gemm)
    chunk = chunk or max(1, min(N, TILE_ELEMENTS // V))
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    if sparse and grad:
        assert support is not None, "the sparse backward needs a support (see loss.sparse_ok)"
        return _SparseHead.apply(hidden, weight, labels, support.ids, support.offsets, support.replayed,
                                 support.host_offsets, temperature, chunk)
    if grad and N * V > KEEP_ELEMENTS:  # recompute each chunk's logits in the backward
        def fn(*args):
            return checkpoint(_chunk, *args, use_reentrant=False)
    else:  # small (a tiny vocabulary): autograd keeps them, faster on the default CPU job (bench/phases.py)
        fn = _chunk
    return tuple(_chunks(hidden, weight, labels, support, temperature, chunk, fn))


# ----------------------------------------------------------------------------- sparse backward

class _SparseHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, ids, offsets, replayed, host_offsets: np.ndarray,
                temperature: float, chunk: int):
        sup = TokenSupport(ids, offsets, ids.new_zeros(0, dtype=torch.float32), replayed, host_offsets)
        logp, ent, slp = _chunks(hidden, weight, labels, sup, temperature, chunk, _chunk)
        ctx.save_for_backward(hidden, weight, labels, ids, offsets, replayed, slp)
        ctx.host_offsets, ctx.temperature = host_offsets, temperature
        ctx.mark_non_differentiable(ent)
        return logp, ent, slp

    @staticmethod
    def backward(ctx, g_logp, _g_entropy, g_slp):
        hidden, weight, labels, ids, offsets, replayed, slp = ctx.saved_tensors
        N, nnz = hidden.shape[0], ids.shape[0]
        g_logp = hidden.new_zeros(N, dtype=torch.float32) if g_logp is None else g_logp.float()
        g_slp = hidden.new_zeros(nnz, dtype=torch.float32) if g_slp is None else g_slp.float()
        rows = entry_rows(offsets, nnz)
        # G_t, the coefficient on the normalizer; a replayed row takes -G_t*p_S on its entries
        G = g_logp + torch.segment_reduce(g_slp, "sum", offsets=offsets, unsafe=True)
        coef = torch.where(replayed[rows], g_slp - G[rows] * slp.exp(), g_slp)  # (nnz,)
        d_hidden = None
        if ctx.needs_input_grad[0]:
            d_hidden = _grad_hidden(weight, labels, ids, offsets, ctx.host_offsets, g_logp, coef,
                                    ctx.temperature, hidden.shape[1]).to(hidden.dtype)
        d_weight = None
        if ctx.needs_input_grad[1]:
            keys = torch.cat([labels.long(), ids.long()])  # (N + nnz,) the triples' vocab ids
            toks = torch.cat([torch.arange(N, device=rows.device), rows])
            d_weight = _grad_weight(hidden, keys, toks, torch.cat([g_logp, coef]), weight.shape[0],
                                    ctx.temperature).to(weight.dtype)
        return d_hidden, d_weight, None, None, None, None, None, None, None


def _spans(host_offsets: np.ndarray, budget: int) -> list[tuple[int, int]]:
    """Token ranges [c0, c1) whose tokens plus support entries stay within `budget` rows
    (a token wider than the budget gets a span of its own). Host offsets: no sync."""
    cost = np.arange(len(host_offsets)) + host_offsets  # rows up to token c, strictly increasing
    spans, c0, N = [], 0, len(host_offsets) - 1
    while c0 < N:
        c1 = max(c0 + 1, int(np.searchsorted(cost, cost[c0] + budget, side="right")) - 1)
        spans.append((c0, c1))
        c0 = c1
    return spans


def _grad_hidden(weight, labels, ids, offsets, host_offsets, g_logp, coef, temperature: float, H: int):
    """d_hidden[t] = (g_logp[t]*W[label_t] + sum over row t of coef_e*W[v_e]) / T, from
    gathered W rows, one span of tokens at a time; the row sums are segment sums (CSR)."""
    N = labels.shape[0]
    d_hidden = torch.empty(N, H, dtype=torch.float32, device=weight.device)
    for c0, c1 in _spans(host_offsets, max(1, TILE_ELEMENTS // (4 * H))):
        a, b = int(host_offsets[c0]), int(host_offsets[c1])
        w_e = weight[ids[a:b].long()].float() * coef[a:b, None]  # (nnz_c, H)
        per_row = torch.segment_reduce(w_e, "sum", offsets=offsets[c0:c1 + 1] - a, axis=0, unsafe=True)
        d_hidden[c0:c1] = (g_logp[c0:c1, None] * weight[labels[c0:c1]].float() + per_row) / temperature
    return d_hidden


def _grad_weight(hidden, keys, toks, coefs, V: int, temperature: float) -> torch.Tensor:
    """d_W[v] = sum over triples (t, v, c) of c*hidden[t]/T: a stable sort by vocab id, then
    a segment sum per vocab id over blocks of the sorted triples, blocks added in order.
    Deterministic by construction (the GPU kernel's contract: no float atomics)."""
    order = torch.argsort(keys, stable=True)
    keys, toks, coefs = keys[order], toks[order], coefs[order]
    block = max(1, TILE_ELEMENTS // (4 * hidden.shape[1]))
    d_weight = None
    for s in range(0, keys.shape[0], block):
        k = keys[s:s + block]
        vals = hidden[toks[s:s + block]].float() * coefs[s:s + block, None]  # (B, H)
        lengths = torch.bincount(k, minlength=V)  # integer counts: exact on any device
        part = torch.segment_reduce(vals, "sum", lengths=lengths, axis=0, unsafe=True)  # (V, H)
        d_weight = part if d_weight is None else d_weight + part
    if d_weight is None:
        d_weight = hidden.new_zeros(V, hidden.shape[1], dtype=torch.float32)
    return d_weight / temperature


# ============================================================================= the Triton kernels

# `triton_head` is `head` on CUDA as six kernels, each beside its launcher, under two
# torch.library custom ops with fake implementations (so the head composes with torch.compile):
# - forward: `_lse_kernel` runs over token blocks x vocabulary tiles, one tl.dot tile of
#   logits at a time, keeping an online max, sum of exp and sum of exp*logit per token
#   (log-sum-exp and entropy); the vocabulary is split across programs to fill the GPU and
#   the splits are merged in torch. `_support_kernel` takes the label logit and each support
#   entry's logit as dot products of gathered rows (N + nnz dots of length H, far cheaper
#   than fishing them out of [BLOCK_N, BLOCK_V] tiles) with an online log-sum-exp over the
#   row; the renormalization is one torch gather.
# - dense backward: per chunk of the vocabulary, `_softmax_grad_kernel` recomputes the logits
#   tiles and writes dlogits = -G'_t*p/T (G' = G on non-replayed rows; a replayed row's
#   normalizer term is sparse) plus the label and support coefficients that land in the tile
#   (the triples are sorted into (vocab tile, token block) buckets, added with a one-hot dot,
#   no atomics) as one [N, chunk] tile in the weights' dtype; then `_matmul_kernel` twice:
#   d_hidden += dlogits @ W[chunk] into an fp32 [N, H] buffer, and d_W[chunk] = dlogits.T @
#   hidden, accumulated over all N tokens in fp32 registers and written once in the weights'
#   dtype (no fp32 [V, H] buffer, no second rounding).
# - sparse backward: `_sparse_dh_kernel` (one program per token and H block: the label's and
#   the row's W rows times their coefficients) and `_sparse_dw_kernel` (one program per vocab
#   id and H block: a loop over that id's run of the sorted triples); the sort and the run
#   starts (searchsorted) are torch.

# Kernel bodies are plain functions here, decorated by `_triton()` on first use, so importing
# floe never imports triton. A kernel body resolves `tl` from this module's globals when it
# is compiled or interpreted. Triton decides at its own import whether @triton.jit compiles
# or interprets (TRITON_INTERPRET=1: numpy, one program at a time, for tensors on any device;
# its own tl.* helpers are decorated then too), so the CPU path needs TRITON_INTERPRET=1 set
# before triton is first imported; tests/test_triton.py runs its CPU tests in a subprocess.

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


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


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


def _launch_lse(k, t: Tiles, hidden, weight, inv_t: float, programs: int):
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


def _launch_support(k, t: Tiles, hidden, weight, labels, ids, offsets, inv_t: float):
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


def _dense_grads(k, t: Tiles, hidden, weight, lse, scale, toks, cols, coefs, inv_t: float, need_dh: bool,
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


def _sparse_grads(k, t: Tiles, hidden, weight, labels, ids, offsets, g_label, coef, toks, cols, coefs,
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


# ----------------------------------------------------------------------------- the two passes

def _setup(hidden: torch.Tensor, weight: torch.Tensor):
    """Kernels, tiles and operands: GPU tiles when compiled; in the interpreter tiny tiles
    and fp32 copies (tl.dot on bf16 is wrong there)."""
    k = _triton()
    assert hidden.is_cuda or k.interpret, \
        "head(impl='triton') on CPU tensors runs in Triton's interpreter: set TRITON_INTERPRET=1 before importing triton"
    if k.interpret:
        return k, INTERPRET_TILES, hidden.float().contiguous(), weight.float().contiguous()
    return k, GPU_TILES, hidden.contiguous(), weight.contiguous()


def _check(hidden, weight, labels, ids, offsets, replayed) -> None:
    """What every launcher relies on: [N, H] and [V, H] rows with unit stride along H, int64
    CSR offsets, int32 ids, one label and one replayed flag per token, all on one device."""
    N, H = hidden.shape
    assert weight.dim() == 2 and weight.shape[1] == H and hidden.dtype == weight.dtype, (hidden.shape, weight.shape)
    assert hidden.dtype in (torch.float32, torch.bfloat16, torch.float16), hidden.dtype
    assert labels.shape == (N,) and labels.dtype in (torch.int32, torch.int64), (labels.shape, labels.dtype)
    assert offsets.shape == (N + 1,) and offsets.dtype == torch.int64, (offsets.shape, offsets.dtype)
    assert ids.dim() == 1 and ids.dtype == torch.int32 and replayed.shape == (N,) and replayed.dtype == torch.bool
    assert len({x.device for x in (hidden, weight, labels, ids, offsets, replayed)}) == 1, "one device"


def _programs(device: torch.device) -> int:
    """About four programs per SM keep every SM busy through the forward's last wave."""
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def _triton_forward(hidden, weight, labels, ids, offsets, replayed, temperature: float):
    """-> logp [N], entropy [N], support_logp [nnz], lse [N] (saved for the dense backward)."""
    _check(hidden, weight, labels, ids, offsets, replayed)
    k, t, x, w = _setup(hidden, weight)
    inv_t = 1.0 / temperature
    lse, entropy = _launch_lse(k, t, x, w, inv_t, _programs(hidden.device))
    label, raw, lse_s = _launch_support(k, t, x, w, labels, ids, offsets, inv_t)
    norm = torch.where(replayed, lse_s, lse)  # replayed rows: renormalize over the support
    return label - norm, entropy, raw - norm[entry_rows(offsets, ids.shape[0])], lse


def _triton_backward(hidden, weight, labels, ids, offsets, replayed, slp, lse, g_logp, g_slp, temperature: float,
                     sparse: bool, backward_gemm: str, need_dh: bool, need_dw: bool):
    """The coefficients as in the reference's _SparseHead (above), then the dense or
    sparse kernels."""
    _check(hidden, weight, labels, ids, offsets, replayed)
    assert slp.shape == ids.shape and g_slp.shape == ids.shape and lse.shape == g_logp.shape == labels.shape
    k, t, x, w = _setup(hidden, weight)
    N, nnz, inv_t = x.shape[0], ids.shape[0], 1.0 / temperature
    g_logp, g_slp = g_logp.float(), g_slp.float()
    rows = entry_rows(offsets, nnz)
    G = g_logp + torch.segment_reduce(g_slp, "sum", offsets=offsets, unsafe=True) if nnz else g_logp
    coef = torch.where(replayed[rows], g_slp - G[rows] * slp.exp(), g_slp)  # (nnz,)
    toks = torch.cat([torch.arange(N, device=rows.device), rows])  # the (token, vocab id, coef / T) triples
    cols = torch.cat([labels.long(), ids.long()])
    coefs = torch.cat([g_logp, coef]) * inv_t
    if sparse:
        dh, dw = _sparse_grads(k, t, x, w, labels, ids, offsets, g_logp * inv_t, coef * inv_t, toks, cols, coefs,
                               need_dh, need_dw)
    else:
        scale = torch.where(replayed, 0.0, -G) * inv_t  # -G'/T: a replayed row's normalizer term is in coef
        dh, dw = _dense_grads(k, t, x, w, lse, scale, toks, cols, coefs, inv_t, need_dh, need_dw, backward_gemm)
    dh = dh.to(hidden.dtype) if need_dh else hidden.new_zeros(0)
    dw = dw.to(weight.dtype) if need_dw else weight.new_zeros(0)
    return dh, dw


# ----------------------------------------------------------------------------- autograd, composable with compile

@torch.library.custom_op("floe::head_forward", mutates_args=())
def _head_forward(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ids: torch.Tensor,
                  offsets: torch.Tensor, replayed: torch.Tensor, temperature: float, sparse: bool,
                  backward_gemm: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _triton_forward(hidden, weight, labels, ids, offsets, replayed, temperature)


@_head_forward.register_fake
def _(hidden, weight, labels, ids, offsets, replayed, temperature, sparse, backward_gemm):
    N, nnz = hidden.shape[0], ids.shape[0]
    return (hidden.new_empty(N, dtype=torch.float32), hidden.new_empty(N, dtype=torch.float32),
            hidden.new_empty(nnz, dtype=torch.float32), hidden.new_empty(N, dtype=torch.float32))


@torch.library.custom_op("floe::head_backward", mutates_args=())
def _head_backward(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ids: torch.Tensor,
                   offsets: torch.Tensor, replayed: torch.Tensor, slp: torch.Tensor, lse: torch.Tensor,
                   g_logp: torch.Tensor, g_slp: torch.Tensor, temperature: float, sparse: bool, backward_gemm: str,
                   need_dh: bool, need_dw: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _triton_backward(hidden, weight, labels, ids, offsets, replayed, slp, lse, g_logp, g_slp, temperature,
                            sparse, backward_gemm, need_dh, need_dw)


@_head_backward.register_fake
def _(hidden, weight, labels, ids, offsets, replayed, slp, lse, g_logp, g_slp, temperature, sparse, backward_gemm,
      need_dh, need_dw):
    return (torch.empty_like(hidden) if need_dh else hidden.new_empty(0),
            torch.empty_like(weight) if need_dw else weight.new_empty(0))


def _setup_context(ctx, inputs, output):
    hidden, weight, labels, ids, offsets, replayed, temperature, sparse, backward_gemm = inputs
    ctx.save_for_backward(hidden, weight, labels, ids, offsets, replayed, output[2], output[3])
    ctx.temperature, ctx.sparse, ctx.backward_gemm = temperature, sparse, backward_gemm


def _backward(ctx, g_logp, _g_entropy, g_slp, _g_lse):
    hidden, weight, labels, ids, offsets, replayed, slp, lse = ctx.saved_tensors
    need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    dh, dw = _head_backward(hidden, weight, labels, ids, offsets, replayed, slp, lse, g_logp, g_slp,
                            ctx.temperature, ctx.sparse, ctx.backward_gemm, need_dh, need_dw)
    return dh if need_dh else None, dw if need_dw else None, None, None, None, None, None, None, None


_head_forward.register_autograd(_backward, setup_context=_setup_context)


def triton_head(hidden, weight, labels, support: TokenSupport | None, temperature: float, sparse: bool,
                backward_gemm: str):
    """`head`'s contract on the kernels, for the arguments `head` has checked. No
    support is an empty one (no replayed row); backward_gemm ("triton" or "torch") picks how
    the dense backward runs its two GEMMs (`_gemm`)."""
    assert backward_gemm in ("triton", "torch"), backward_gemm
    N = hidden.shape[0]
    if support is None:
        grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
        assert not (sparse and grad), "the sparse backward needs a support (see loss.sparse_ok)"
        ids = torch.zeros(0, dtype=torch.int32, device=hidden.device)
        offsets = torch.zeros(N + 1, dtype=torch.int64, device=hidden.device)
        replayed = torch.zeros(N, dtype=torch.bool, device=hidden.device)
    else:
        ids, offsets, replayed = support.ids, support.offsets, support.replayed
    logp, entropy, slp, _ = _head_forward(hidden, weight, labels, ids, offsets, replayed, float(temperature), sparse,
                                          backward_gemm)
    return logp, entropy.detach(), slp
