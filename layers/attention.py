"""Attention of the packed training forward: who attends to whom, and how it is computed.

Documents are packed into one [T] row (data.pack). A token attends to earlier tokens of its own
document and to the whole of its document's parent (a group's shared prompt). Three ways to
compute it, one result:
- `Rows` (the CPU): each document a row of its own queries against its parent's and its own
  keys, rows batched by length, so the work grows with the documents and not with [T, T];
- a flex-attention BlockMask (CUDA): the blocks between documents are skipped;
- a dense [1, 1, T, T] bool mask: the tests' reference.
Under torch.compile on a CPU `Rows` runs as one opaque op, `floe::rows_attention`, fed the
document ids themselves: `Rows`' shapes follow each packing and would each guard a graph.

    python -m pytest -q tests/test_compile.py tests/test_packing.py
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention


_compiled_flex = None


@dataclass
class Rows:
    """The packed forward's attention as a few dense batches, one row per document: its own tokens
    as queries, its parent's tokens and its own as keys (CPU). Work grows with the documents'
    lengths, not the buffer's: on the default job far fewer scores than a dense [T, T] mask over the
    same buffers (docs/experiments.md "2026-12-01: the CPU step, before and after four changes")."""

    buckets: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # (query idx, key idx, mask) per length class
    back: torch.Tensor  # (T,) each token's place among the buckets' flattened query slots


def document_rows(doc_ids: torch.Tensor, parents: torch.Tensor | None) -> Rows:
    """Rows for packed documents (each contiguous; a parent before its children). A row is padded
    to its bucket's longest: padded queries repeat the row's last own token, padded keys are
    masked out."""
    doc = doc_ids.cpu().numpy()
    par = np.full_like(doc, -1) if parents is None else parents.cpu().numpy()
    T = len(doc)
    start = np.flatnonzero(np.r_[True, doc[1:] != doc[:-1]])
    end = np.r_[start[1:], T]
    assert len(np.unique(doc[start])) == len(start), "documents must be contiguous"
    span = dict(zip(doc[start].tolist(), zip(start.tolist(), end.tolist())))
    p_start, p_len = np.zeros(len(start), dtype=np.int64), np.zeros(len(start), dtype=np.int64)
    for r, s in enumerate(start):
        if par[s] >= 0:
            a, b = span[int(par[s])]
            p_start[r], p_len[r] = a, b - a
    own = end - start
    pow2 = lambda n: 1 << np.ceil(np.log2(n)).astype(np.int64)  # noqa: E731
    # a bucket: keys and queries each up to a power of two; a prompt's row and its completions'
    # rows part (one bucket for both would pad ~10 queries to ~40)
    bucket = pow2(p_len + own) * 2 * T + pow2(own)
    buckets, back, at = [], np.zeros(T, dtype=np.int64), 0
    for w in np.unique(bucket):
        r = np.flatnonzero(bucket == w)
        Lq, Lk = int(own[r].max()), int((p_len[r] + own[r]).max())
        j = np.arange(Lq)[None, :]
        q = start[r, None] + np.minimum(j, own[r, None] - 1)  # (R, Lq)
        k = np.arange(Lk)[None, :] - p_len[r, None]  # (R, Lk): < 0 the parent's keys, else own
        kidx = np.where(k < 0, p_start[r, None] + k + p_len[r, None], start[r, None] + np.clip(k, 0, None))
        kidx = np.where(k < own[r, None], kidx, start[r, None])  # padded keys: masked below
        mask = (k[:, None, :] < 0) | ((k[:, None, :] <= j[:, :, None]) & (k[:, None, :] < own[r, None, None]))
        real = j < own[r, None]
        back[q[real]] = at + np.flatnonzero(real.ravel())
        at += q.size
        buckets.append(tuple(torch.from_numpy(x).to(doc_ids.device) for x in (q, kidx, mask[:, None])))
    return Rows(buckets, torch.from_numpy(back).to(doc_ids.device))


@dataclass
class Documents:
    """The packed documents themselves, for `rows_attention` under torch.compile on a CPU."""

    doc_ids: torch.Tensor
    parents: torch.Tensor | None


def document_mask(doc_ids: torch.Tensor, parents: torch.Tensor | None = None, mode: str = "auto"):
    """Who attends to whom in packed rows: the same document and not the future, or the document's
    parent (a shared prompt). A dense [1, 1, T, T] bool mask, a flex BlockMask, or `Rows`; `mode`
    (the model's `attention`): auto (CUDA flex; CPU rows) | flex | rows | dense."""
    T = doc_ids.shape[0]
    mode = mode if mode != "auto" else ("flex" if doc_ids.is_cuda else "rows")
    par = torch.full_like(doc_ids, -1) if parents is None else parents
    if mode == "rows":
        return Documents(doc_ids, parents) if torch.compiler.is_compiling() else document_rows(doc_ids, parents)
    if mode == "flex":
        def tree(b, h, q, k):
            return ((doc_ids[q] == doc_ids[k]) & (k <= q)) | (par[q] == doc_ids[k])

        return create_block_mask(tree, None, None, T, T, device=doc_ids.device)
    causal = torch.ones(T, T, dtype=torch.bool, device=doc_ids.device).tril()
    return (((doc_ids[:, None] == doc_ids[None, :]) & causal) | (par[:, None] == doc_ids[None, :]))[None, None]


def attend(q, k, v, mask) -> torch.Tensor:
    """SDPA under a bool mask or per `Rows` bucket, or flex attention under a BlockMask (compiled on
    CUDA, eager on the CPU)."""
    global _compiled_flex
    if isinstance(mask, Rows):
        return _attend_rows(q, k, v, mask)
    if isinstance(mask, Documents):  # one dtype, v's, as autocast gives SDPA: the op runs outside autocast
        return rows_attention(q.to(v.dtype), k.to(v.dtype), v, mask.doc_ids, mask.parents)
    if not isinstance(mask, BlockMask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    # under autocast RoPE's fp32 cos/sin (and qk-norm) leave q and k in fp32 while v is the autocast
    # dtype; flex's backward refuses mixed dtypes, and SDPA would run all three in v's (autocast's)
    q, k = q.to(v.dtype), k.to(v.dtype)
    if not q.is_cuda:
        return flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex(q, k, v, block_mask=mask, enable_gqa=True)


def _attend_rows(q, k, v, rows: Rows) -> torch.Tensor:
    """q (1, n_head, T, hd), k, v (1, n_kv, T, hd) -> (1, n_head, T, hd), one SDPA per bucket.
    index_select, not indexing: its backward (index_add) sums a shared prompt's key gradients in
    a fixed order, so a run repeats bit for bit."""
    outs = []
    for qi, ki, mask in rows.buckets:
        (R, Lq), Lk = qi.shape, ki.shape[1]
        qb = q[0].index_select(1, qi.flatten()).view(-1, R, Lq, q.shape[3]).transpose(0, 1)  # (R, n_head, Lq, hd)
        kb, vb = (x[0].index_select(1, ki.flatten()).view(-1, R, Lk, x.shape[3]).transpose(0, 1) for x in (k, v))
        y = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, enable_gqa=True)
        outs.append(y.transpose(0, 1).reshape(q.shape[1], R * Lq, q.shape[3]))
    return torch.cat(outs, 1).index_select(1, rows.back)[None]


# `Rows` inside a compiled forward: an op the graph calls with the document ids, whose shapes never
# change, so one graph serves every packing. It builds `Rows` itself (once per packing: each layer
# and the backward of the same micro-batch find them in `_seen`) and runs `_attend_rows` eagerly;
# its backward runs the attention again under torch.func.vjp (a custom op runs below autograd),
# which costs one more attention forward and gives the eager path's gradients bit for bit.
_seen: tuple | None = None  # (doc_ids, parents, their Rows) of the last packing


def _attend_documents(q, k, v, doc_ids: torch.Tensor, parents: torch.Tensor | None) -> torch.Tensor:
    """`_attend_rows` over the documents' `Rows`, kept for the last packing (compared by content: a
    freed buffer's address can come back holding another packing); outside autocast, whose state
    differs between the forward and the backward (q, k and v share one dtype)."""
    global _seen
    if _seen is None or not (_equal(_seen[0], doc_ids) and _equal(_seen[1], parents)):
        # one assignment: another thread never sees one packing's ids with another's rows
        _seen = doc_ids.clone(), None if parents is None else parents.clone(), document_rows(doc_ids, parents)
    with torch.autocast(q.device.type, enabled=False):
        return _attend_rows(q, k, v, _seen[2])


def _equal(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is b if a is None or b is None else a.shape == b.shape and torch.equal(a, b)


@torch.library.custom_op("floe::rows_attention", mutates_args=())
def rows_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor,
                   parents: torch.Tensor | None) -> torch.Tensor:
    """(1, n_head, T, hd), in q's dtype: `_attend_documents` as one op."""
    return _attend_documents(q, k, v, doc_ids, parents)


# The fakes say what a graph may assume of each output (shape, dtype, strides). Inductor's on-disk
# cache keys a compiled graph by the ops it calls, not by their fakes: after editing one, empty the
# cache (TORCHINDUCTOR_CACHE_DIR, by default /tmp/torchinductor_$USER) or a cached graph keeps the old.
@rows_attention.register_fake
def _(q, k, v, doc_ids, parents):
    return q.new_empty(q.shape)


@torch.library.custom_op("floe::rows_attention_backward", mutates_args=())
def rows_attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            doc_ids: torch.Tensor, parents: torch.Tensor | None
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _, vjp = torch.func.vjp(lambda q, k, v: _attend_documents(q, k, v, doc_ids, parents), q, k, v)
    return tuple(g.contiguous() for g in vjp(grad))  # the strides the fake promises


@rows_attention_backward.register_fake
def _(grad, q, k, v, doc_ids, parents):
    return tuple(x.new_empty(x.shape) for x in (q, k, v))


def _setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad):
    return *rows_attention_backward(grad, *ctx.saved_tensors), None, None


rows_attention.register_autograd(_backward, setup_context=_setup)
