"""The sequence and KL masks (--seq-mask, --kl-mask) and the per-token arithmetic the loss and its
metrics share: sums per sequence without a host sync, bounds decided in log space, (sum, count)
metrics. loss.py applies the masks; --correction-metrics-only reports what they would remove.

A sequence is a document of the micro-batch (packing never splits a sample), so a per-sequence
value is an index_add over `doc_ids`.

    python -m pytest -q tests/test_loss.py      # against a dense fp64 reference
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from config import Config

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
