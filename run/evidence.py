"""The sampler's evidence, checked before the loss reads it: each loss token's label and log q,
and its support row (ids, log q, the replayed flag), as the engine reported them.

Every check is named in CHECKS with the sentence an error gives. They run on the device, one
[T] flag row per check and micro-batch, with one host read for the whole step:
- `--bad-evidence error` (the default) stops the run naming the sample, its token and the check;
- `--bad-evidence drop` takes the bad samples out of the loss (loss_mask) and counts them in
  `bad_evidence/dropped`; call it before loss.denominators, so they leave the counts too.

Only what the loss reads is checked: the loss tokens and their rows. An empty replayed row fails
(it cannot hold its sampled token); an empty draws row fails on a trained token of a centered
loss (its score centering reads the row, and the sparse backward is exact only with it) and is
fine for ppo, cispo and the like. Broken offsets are a packing bug, not a sampler's: they raise
even under `--bad-evidence drop`.

    python -m pytest -q tests/test_loss.py -k evidence
"""

from __future__ import annotations

import torch
from torch import Tensor

from config import Config
from data import MicroBatch, RunError, entry_rows
from loss import trained
from layers.masks import Metrics, any_by, sum_by

CHECKS = {  # name: what the error says
    "offsets": "support offsets are not non-decreasing from 0 to nnz",  # structural: always raises
    "label": "label not in [0, V)",
    "support_id": "support id not in [0, V)",
    "logq_nan": "logq is not finite (NaN or inf)",
    "logq_positive": "logq > 0",
    "support_logq_nan": "support logq is not finite (NaN or inf)",
    "support_logq_positive": "support logq > 0",
    "replayed_label": "replayed row lacks its sampled token",
    "replayed_mass": "replayed q does not sum to 1 (tolerance 1e-3)",
    "draws_size": "draws row size != --score-centering-k",
    "draws_empty": "draws row is empty on a trained token (its score centering, and the sparse backward, need the K draws)",
}


def failures(mb: MicroBatch, vocab_size: int, k: int, centered: bool) -> tuple[dict[str, Tensor], Tensor | None]:
    """{check: [T] bool, the tokens failing it} in CHECKS' order, and each support entry's row."""
    mask, labels, logq, sup, row = mb.loss_mask, mb.labels, mb.logq, mb.support, None
    T = mask.numel()
    f = dict.fromkeys(CHECKS, torch.zeros_like(mask))
    f["label"] = (labels < 0) | (labels >= vocab_size)
    f["logq_nan"], f["logq_positive"] = ~torch.isfinite(logq), logq > 0
    if sup is not None:
        if sup.offsets.numel() != T + 1:
            raise RunError(f"bad sampler evidence: support has {sup.offsets.numel() - 1} rows for {T} tokens")
        off, ids, slq = sup.offsets, sup.ids.long(), sup.logq
        counts, row = off[1:] - off[:-1], entry_rows(off, ids.numel())
        ends = torch.zeros_like(mask)
        ends[0], ends[-1] = off[0] != 0, off[-1] != ids.numel()
        f["offsets"] = (counts < 0) | ends
        f["support_id"] = any_by(row, (ids < 0) | (ids >= vocab_size), T)  # an entry's failure is its row's
        f["support_logq_nan"] = any_by(row, ~torch.isfinite(slq), T)
        f["support_logq_positive"] = any_by(row, slq > 0, T)
        f["replayed_label"] = sup.replayed & ~any_by(row, ids == labels[row], T)
        mass = sum_by(row, slq.double().exp(), T)
        f["replayed_mass"] = sup.replayed & (counts > 0) & ~((mass - 1).abs() <= 1e-3)
        f["draws_size"] = ~sup.replayed & (counts > 0) & (counts != k)
        f["draws_empty"] = ~sup.replayed & (counts == 0) & centered
    # only what the loss reads; offsets are checked on every row
    return {name: x if name == "offsets" else x & mask for name, x in f.items()}, row


def _drop(mb: MicroBatch, bad: Tensor, row: Tensor | None, vocab_size: int) -> None:
    """Untrain every token of the bad samples; zero their out-of-range ids so the head can gather."""
    gone = (mb.sample_idx >= 0) & bad[mb.sample_idx.clamp(min=0)]
    mb.loss_mask &= ~gone
    mb.labels.masked_fill_(gone & ((mb.labels < 0) | (mb.labels >= vocab_size)), 0)
    if row is not None:
        ids = mb.support.ids
        ids.masked_fill_(gone[row] & ((ids < 0) | (ids >= vocab_size)), 0)


def validate(micro_batches: list[MicroBatch], vocab_size: int, cfg: Config) -> Metrics:
    """Check the step's evidence on the device; one host sync at the end. Raises RunError naming
    the sample, its token and the check, or (--bad-evidence drop) untrains the bad samples in
    place and returns how many it dropped."""
    if not micro_batches:
        return {}
    dev = micro_batches[0].loss_mask.device
    space = max((max(mb.samples) + 1 for mb in micro_batches if mb.samples), default=1)
    bad = torch.zeros(space, dtype=torch.int64, device=dev)  # failures per sample index
    centered = trained(cfg).centered  # these read every trained token's row
    firsts, rows = [], []
    for mb in micro_batches:
        named, row = failures(mb, vocab_size, cfg.score_centering_k, centered)
        fails = torch.stack(list(named.values()))  # [checks, T]
        T = fails.shape[1]
        t = torch.arange(T, device=dev)
        pos = torch.where(fails, t, T).amin(dim=1)  # first failure of each check; T: none
        at = pos.clamp(max=T - 1)
        start = torch.full_like(t, T).scatter_reduce(0, mb.doc_ids, torch.where(mb.loss_mask, t, T), "amin")
        token = t - start[mb.doc_ids]  # k for the k-th completion token of its sample (its document)
        firsts.append(torch.stack([pos, mb.sample_idx[at], token[at]]))
        hit = fails[1:].any(0) & (mb.sample_idx >= 0)  # every check but offsets (the first, structural)
        bad.index_add_(0, mb.sample_idx.clamp(min=0), hit.long())
        rows.append(row)
    if cfg.bad_evidence == "drop":
        for mb, row in zip(micro_batches, rows):
            _drop(mb, bad > 0, row, vocab_size)
    counts = [mb.loss_mask.sum() for mb in micro_batches] + [(bad > 0).sum()]  # ..., samples dropped
    host = torch.cat([torch.stack(firsts).flatten(), torch.stack(counts)]).tolist()  # the one sync
    names, C, M = list(CHECKS), len(CHECKS), len(micro_batches)
    for i, mb in enumerate(micro_batches):
        pos, sample, token = (host[(3 * i + j) * C:(3 * i + j + 1) * C] for j in range(3))
        c = next((c for c in range(C) if pos[c] < mb.loss_mask.numel()), None)
        if c is not None and (cfg.bad_evidence == "error" or names[c] == "offsets"):
            raise RunError(f"bad sampler evidence: sample {sample[c]}, token {token[c]}: {CHECKS[names[c]]} "
                           f"(micro-batch {i}, position {pos[c]})")
    for mb, n in zip(micro_batches, host[3 * C * M:-1]):
        mb.num_loss_tokens = int(n)
    dropped = torch.tensor([host[-1], sum(len(mb.samples) for mb in micro_batches)], dtype=torch.float64, device=dev)
    return {"bad_evidence/dropped": (dropped[0], dropped[1])}
