"""The LM head fused with the log-softmax: per-token label log-prob, entropy and support
log-probs, without ever holding [N, V] logits.

    head(hidden[N,H], weight[V,H], labels[N], support | None, temperature)
        -> logp[N] fp32, entropy[N] fp32 (no grad), support_logp[nnz] fp32

logp is log p(label) at the temperature; for a replayed support row (sampling truncated
by top-p/top-k) it is renormalized over that row's support, as the sampler drew it.
support_logp is log p(v) for each support entry, renormalized the same way.

Simplifications:
1. This is the plain-torch chunked reference: the CPU path and the oracle for the Triton
   kernels to come. Each token chunk runs under activation checkpointing, so the forward
   keeps only per-token scalars and the backward recomputes one chunk's logits at a time
   (the dense backward). Peak extra memory is one [chunk, V] fp32 tile.
2. Logits are computed in the weights' dtype and upcast to fp32 before the softmax.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from data import TokenSupport

TILE_ELEMENTS = 1 << 25  # a [chunk, V] fp32 tile of at most 128 MiB


def _rows(offsets: torch.Tensor, nnz: int) -> torch.Tensor:
    """The row of each support entry, from CSR offsets, without a host sync."""
    return torch.searchsorted(offsets, torch.arange(nnz, device=offsets.device), right=True) - 1


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
    rows = _rows(offsets, nnz)
    sup_logit = logits[rows, ids.long()]  # (nnz,)
    lse_s = _row_logsumexp(sup_logit, rows, labels.shape[0])
    norm = torch.where(replayed, lse_s, lse)  # replayed rows: renormalize over the support
    return label_logit - norm, entropy, sup_logit - norm[rows]


def head(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
         support: TokenSupport | None = None, temperature: float = 1.0, chunk: int | None = None):
    N, V = hidden.shape[0], weight.shape[0]
    assert hidden.shape[1] == weight.shape[1] and labels.shape == (N,), (hidden.shape, weight.shape, labels.shape)
    assert support is None or support.num_rows == N, "support needs one row per token"
    chunk = chunk or max(1, min(N, TILE_ELEMENTS // V))
    logp, ent, slp = [], [], []
    for c0 in range(0, N, chunk):
        c1 = min(N, c0 + chunk)
        if support is None:
            sup = TokenSupport.empty(c1 - c0, hidden.device)
        else:
            sup = support.slice(c0, c1)
        args = (hidden[c0:c1], weight, labels[c0:c1], sup.ids, sup.offsets, sup.replayed, temperature, sup.nnz)
        if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
            out = checkpoint(_chunk, *args, use_reentrant=False)
        else:
            out = _chunk(*args)
        logp.append(out[0]), ent.append(out[1]), slp.append(out[2])
    return torch.cat(logp), torch.cat(ent), torch.cat(slp)
