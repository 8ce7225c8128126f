"""The sequence and KL masks (--seq-mask, --kl-mask), M2PO's bound (--m2po-threshold: `m2po_bound`,
found over the whole step before the first backward) and the per-token arithmetic the loss and its
metrics share: sums per sequence without a host sync, bounds decided in log space, (sum, count)
metrics, added up over micro-batches (`accumulate`) and read out once per device (`reduce_metrics`).
loss.py applies the masks and the bound; --correction-metrics-only reports what they would remove.

A sequence is a document of the micro-batch (packing never splits a sample), so a per-sequence
value is an index_add over `doc_ids`.

    python -m pytest -q tests/test_loss.py      # against a dense fp64 reference
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from config import Config
from data import MicroBatch

Metrics = dict[str, tuple[Tensor, Tensor]]

METRIC_CLAMP = 20.0  # |log r| cap for metrics and KL masks only


def sum_by(idx: Tensor, x: Tensor, size: int) -> Tensor:
    """[size, ...]: the sum of x's entries with each index (index_add, no host sync)."""
    return x.new_zeros((size, *x.shape[1:])).index_add(0, idx, x)


def any_by(idx: Tensor, flags: Tensor, size: int) -> Tensor:
    """[size] bool: OR of `flags` over the entries with each index."""
    return sum_by(idx, flags.long(), size) > 0


def outside(log_r: Tensor, low: float, high: float) -> tuple[Tensor, Tensor, float, float]:
    """(log r < log low, log r > log high, log low, log high); inclusive bounds, low = 0: none."""
    lo, hi = (math.log(low) if low > 0 else -math.inf), math.log(high)
    return log_r < lo, log_r > hi, lo, hi


def stat(values: Tensor, on: Tensor) -> tuple[Tensor, Tensor]:
    """(sum over the tokens `on`, their count); where, not a product, keeps an inf elsewhere out."""
    return torch.where(on, values.detach(), 0.0).sum(), on.sum().to(values.dtype)


def k3(log_r: Tensor) -> Tensor:
    """r - 1 - log r, an estimate of KL(q||p) from a draw of q; expm1: no -1e-9 at r ~ 1."""
    lr = log_r.clamp(-METRIC_CLAMP, METRIC_CLAMP)
    return (torch.expm1(lr) - lr).clamp(min=0)


@dataclass(frozen=True)
class Masks:
    """--seq-mask and --kl-mask with their bounds ("off": that mask is not applied)."""

    seq: str = "off"
    seq_low: float = 0.5
    seq_high: float = 2.0
    kl: str = "off"
    kl_threshold: float = 0.5
    kl_directional: bool = False  # DPPO: a KL mask acts only where the update would move the token further

    @staticmethod
    def of(cfg: Config) -> Masks:
        return Masks(cfg.seq_mask, cfg.seq_mask_low, cfg.seq_mask_high, cfg.kl_mask, cfg.kl_mask_threshold,
                     cfg.kl_mask_directional)


def seq_flags(logp: Tensor, logq: Tensor, doc_ids: Tensor, mask: Tensor, m: Masks) -> dict[str, Tensor]:
    """Loss tokens of the sequences each --seq-mask removes: the geometric mean of the ratios
    (a mean in log space, finite at any length), or any one ratio, outside [low, high]."""
    log_r = logp - logq
    x = torch.stack([mask.to(log_r.dtype), torch.where(mask, log_r, 0.0)], 1)
    n, total = sum_by(doc_ids, x, len(x)).unbind(1)  # per sequence
    geo = outside((total / n.clamp(min=1))[doc_ids], m.seq_low, m.seq_high)
    worst = outside(log_r, m.seq_low, m.seq_high)
    worst = any_by(doc_ids, mask & (worst[0] | worst[1]), mask.numel())[doc_ids]
    return {"seq_geometric": mask & (geo[0] | geo[1]), "seq_max": mask & worst}


def kl_flags(logp: Tensor, logq: Tensor, adv: Tensor, doc_ids: Tensor, mask: Tensor, m: Masks) -> dict[str, Tensor]:
    """Loss tokens each --kl-mask removes (OR-ed per sequence under --seq-mask): an estimate
    of KL(q||p) at the sampled token, or the TV of the two Bernoullis, above the threshold; log r
    clamped to +-20. Directional (DPPO, arXiv 2602.04879): only where A pushes p(a) further from q(a)."""
    lr = (logp - logq).clamp(-METRIC_CLAMP, METRIC_CLAMP)
    l1q, l1p = ((-x.clamp(max=0).expm1()).log().clamp(min=-METRIC_CLAMP) for x in (logq, logp))  # log(1 - e^x)
    est = {"k1": lr.abs(), "k3": k3(lr), "binary": logq.exp() * -lr + l1q.exp() * (l1q - l1p),
           "binary_tv": (logp.exp() - logq.exp()).abs()}  # TV(Bern(q(a)), Bern(p(a))) = |p(a) - q(a)|
    on = mask & (((adv > 0) & (logp > logq)) | ((adv < 0) & (logp < logq))) if m.kl_directional else mask
    flags = {f"kl_{k}": on & (v > m.kl_threshold) for k, v in est.items()}
    if m.seq == "off":
        return flags
    return {k: mask & any_by(doc_ids, v, mask.numel())[doc_ids] for k, v in flags.items()}


def keep_mask(logp: Tensor, logq: Tensor, adv: Tensor, doc_ids: Tensor, mask: Tensor, m: Masks,
              metrics: Metrics) -> Tensor:
    """False on the tokens that --seq-mask and --kl-mask take out of the policy term."""
    drop = torch.zeros_like(mask)
    for kind, choice in (("kl", m.kl), ("seq", m.seq)):
        if choice != "off":
            flags = kl_flags(logp, logq, adv, doc_ids, mask, m) if kind == "kl" else seq_flags(logp, logq, doc_ids, mask, m)
            f = flags[f"{kind}_{choice}"]
            metrics[f"{kind}_mask/masked_fraction"] = stat(f.to(logp.dtype), mask)
            drop = drop | f
    return ~drop


# ----------------------------------------------------------------------------- M2PO's bound

def m2po_bound(old: list[Tensor], micro_batches: list[MicroBatch], tau: float,
               gather: Callable[[Tensor], Tensor] = lambda x: x) -> float:
    """M2PO (arXiv 2510.01161): the largest (log r)^2, r = pi_old/q, a loss token may have so that the mean
    over the tokens kept is <= tau, the largest dropped first, over the whole step: this rank's micro-batches
    and, through `gather` (a concatenation in rank order), every other rank's. A bound on the value, so ties
    go together and any split of the batch gives the same mask; -1 drops every token. Its host syncs come
    before the first backward, with pi_old."""
    x = torch.cat([torch.where(mb.loss_mask, (o - mb.logq.to(o.dtype)) ** 2, -1.0) for o, mb in zip(old, micro_batches)])
    x = gather(x.detach().cpu())
    xs = x[x >= 0].double().sort().values  # rl_loss compares in the dtype of log p: the bound is one of these values
    if not len(xs):
        return math.inf
    means = xs.cumsum(0) / torch.arange(1, len(xs) + 1, dtype=xs.dtype)
    ends = torch.cat([xs[1:] > xs[:-1], torch.ones(1, dtype=torch.bool)])  # the last of each run of equal values
    fits = ends & (means <= tau)
    return xs[fits].max().item() if fits.any() else -1.0


# ----------------------------------------------------------------------------- (sum, count) metrics

def accumulate(total: Metrics, metrics: Metrics) -> None:
    """Add (sum, count) pairs into `total` on the device; no sync."""
    for k, (s, c) in metrics.items():
        s0, c0 = total.get(k, (0.0, 0.0))
        total[k] = (s0 + s.detach(), c0 + c)


def reduce_metrics(total: Metrics) -> dict[str, float]:
    """{name: sum / count}, read once per device (the rollout's stats are host tensors, the step's
    metrics device ones, and stack takes one device); names with a zero count are left out."""
    flat = [torch.as_tensor(x, dtype=torch.float64) for pair in total.values() for x in pair]  # sum, count, ...
    values = {}
    for device in {x.device for x in flat}:
        at = [i for i, x in enumerate(flat) if x.device == device]
        values.update(zip(at, torch.stack([flat[i] for i in at]).tolist()))
    return {k: values[2 * j] / values[2 * j + 1] for j, k in enumerate(total) if values[2 * j + 1] != 0}
