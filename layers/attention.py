"""Attention of the packed training forward: who attends to whom, and how it is computed.

Documents are packed into one [T] row (data.pack). A token attends to earlier tokens of its own
document and to the whole of its document's parent (a group's shared prompt). Three ways to
compute it, one result:
- `Rows` (the CPU): each document a row of its own queries against its parent's and its own
  keys, rows batched by length, so the work grows with the documents and not with [T, T];
- a flex-attention BlockMask (CUDA): the blocks between documents are skipped;
- a dense [1, 1, T, T] bool mask: under torch.compile on a CPU (`Rows` shapes follow each
  packing, so it would recompile) and as the tests' reference.

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


def document_mask(doc_ids: torch.Tensor, parents: torch.Tensor | None = None, mode: str = "auto"):
    """Who attends to whom in packed rows: the same document and not the future, or the document's
    parent (a shared prompt). A dense [1, 1, T, T] bool mask, a flex BlockMask, or `Rows`; `mode`
    (the model's `attention`): auto (CUDA flex; CPU rows, compiled dense) | flex | rows | dense."""
    T = doc_ids.shape[0]
    # torch.compile takes the dense mask on a CPU: `Rows` shapes follow the documents, so every new
    # packing would recompile
    cpu = "dense" if torch.compiler.is_compiling() else "rows"
    mode = mode if mode != "auto" else ("flex" if doc_ids.is_cuda else cpu)
    par = torch.full_like(doc_ids, -1) if parents is None else parents
    if mode == "rows":
        return document_rows(doc_ids, parents)
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
