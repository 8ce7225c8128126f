"""The LM head fused with the log-softmax: per-token label log-prob, entropy and support
log-probs, without ever holding [N, V] logits. One contract, two implementations, both entered
here: the contract, its maths and the plain-torch chunked reference (the CPU path and the tests'
oracle) first, then `triton_head`, which runs it on CUDA as six Triton kernels: its two passes and
custom ops here, the kernels with their launchers and tiles in layers/headkernels.py.

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
(`headkernels._triton()`), so floe imports and runs without it (requirements.txt does not list it).

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
4. The kernels use fixed tile sizes (`headkernels.GPU_TILES`, chosen for an H100/H200, sm_90: tl.dot wants
   >= 16 per dim), no autotuning: the interpreter accepts exactly one config, and one set keeps
   them deterministic and their compile time short. The dense backward's dlogits tile is
   stored in the weights' dtype (bf16 on GPUs, as in other fused cross-entropy kernels) before
   the two GEMMs; the sums around it are fp32.
5. The dense backward's two GEMMs per vocabulary chunk run as `headkernels._matmul_kernel`
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

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint

from data import TokenSupport, entry_rows
from layers import headkernels

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
    """Run fn (_chunk or a checkpointed _chunk) over token chunks; concatenate its outputs. When one chunk
    holds every token, fn takes the support whole, its nnz from the ids' length: no loop over N and no
    host offsets read, so torch.compile traces it with symbolic N and nnz (train.micro_loss)."""
    N = hidden.shape[0]
    if N > chunk:
        return _sliced(hidden, weight, labels, support, temperature, chunk, fn)
    sup = TokenSupport.empty(N, hidden.device) if support is None else support
    return list(fn(hidden, weight, labels, sup.ids, sup.offsets, sup.replayed, temperature, sup.ids.shape[0]))


@torch.compiler.disable
def _sliced(hidden, weight, labels, support: TokenSupport | None, temperature: float, chunk: int, fn):
    """Several chunks (N * V > TILE_ELEMENTS): each slices the support by its host offsets (numpy) and the
    loop runs over N, which Dynamo can neither trace nor keep symbolic, so under torch.compile this runs
    eager, a graph break on each side."""
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
    assert support is None or support.offsets.shape[0] == N + 1, "support needs one row per token"
    assert impl in ("auto", "triton", "torch"), impl
    if impl == "triton" or (impl == "auto" and hidden.is_cuda and triton_available()):
        return triton_head(hidden, weight, labels, support, temperature, sparse, backward_gemm)
    chunk = chunk or max(1, TILE_ELEMENTS // V)  # from V alone: under torch.compile N is symbolic, V never
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    if sparse and grad:
        assert support is not None, "the sparse backward needs a support (see loss.sparse_ok)"
        return _sparse_head(hidden, weight, labels, support, temperature, chunk)
    if grad and N * V > KEEP_ELEMENTS:  # recompute each chunk's logits in the backward
        def fn(*args):
            return checkpoint(_chunk, *args, use_reentrant=False)
    else:  # small (a tiny vocabulary): autograd keeps them, faster on the default CPU job (bench/phases.py)
        fn = _chunk
    return tuple(_chunks(hidden, weight, labels, support, temperature, chunk, fn))


# ----------------------------------------------------------------------------- sparse backward

@torch.compiler.disable
def _sparse_head(hidden, weight, labels, support: TokenSupport, temperature: float, chunk: int):
    """Eager under torch.compile, a graph break on each side of it: the backward tiles the support by its
    host offsets (numpy, `_spans`) and sizes each tile from them, which Dynamo cannot trace."""
    return _SparseHead.apply(hidden, weight, labels, support.ids, support.offsets, support.replayed,
                             support.host_offsets, temperature, chunk)


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


# ============================================================================= the Triton head

# `triton_head` is `head` on CUDA as six Triton kernels: the kernels, each beside its launcher,
# and their tiles are layers/headkernels.py's (its docstring walks through them). Here: the two
# passes that call the launchers, and the two torch.library custom ops with fake implementations
# around them, so the head composes with torch.compile.


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


# ----------------------------------------------------------------------------- the two passes

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
    k, t, x, w = headkernels.setup(hidden, weight)
    inv_t = 1.0 / temperature
    lse, entropy = headkernels.launch_lse(k, t, x, w, inv_t, _programs(hidden.device))
    label, raw, lse_s = headkernels.launch_support(k, t, x, w, labels, ids, offsets, inv_t)
    norm = torch.where(replayed, lse_s, lse)  # replayed rows: renormalize over the support
    return label - norm, entropy, raw - norm[entry_rows(offsets, ids.shape[0])], lse


def _triton_backward(hidden, weight, labels, ids, offsets, replayed, slp, lse, g_logp, g_slp, temperature: float,
                     sparse: bool, backward_gemm: str, need_dh: bool, need_dw: bool):
    """The coefficients as in the reference's _SparseHead (above), then the dense or
    sparse kernels."""
    _check(hidden, weight, labels, ids, offsets, replayed)
    assert slp.shape == ids.shape and g_slp.shape == ids.shape and lse.shape == g_logp.shape == labels.shape
    k, t, x, w = headkernels.setup(hidden, weight)
    N, nnz, inv_t = x.shape[0], ids.shape[0], 1.0 / temperature
    g_logp, g_slp = g_logp.float(), g_slp.float()
    rows = entry_rows(offsets, nnz)
    G = g_logp + torch.segment_reduce(g_slp, "sum", offsets=offsets, unsafe=True) if nnz else g_logp
    coef = torch.where(replayed[rows], g_slp - G[rows] * slp.exp(), g_slp)  # (nnz,)
    toks = torch.cat([torch.arange(N, device=rows.device), rows])  # the (token, vocab id, coef / T) triples
    cols = torch.cat([labels.long(), ids.long()])
    coefs = torch.cat([g_logp, coef]) * inv_t
    if sparse:
        dh, dw = headkernels.sparse_grads(k, t, x, w, labels, ids, offsets, g_logp * inv_t, coef * inv_t, toks, cols,
                                          coefs, need_dh, need_dw)
    else:
        scale = torch.where(replayed, 0.0, -G) * inv_t  # -G'/T: a replayed row's normalizer term is in coef
        dh, dw = headkernels.dense_grads(k, t, x, w, lse, scale, toks, cols, coefs, inv_t, need_dh, need_dw,
                                         backward_gemm)
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
