"""The parts of the loss that need no loss table (loss.LOSSES): the support rows a term sums over
(`Rows`), the sampler KL (`kl_term`), on-policy distillation (`distill_term`), SAPO's soft gate
(`sapo_gate`), TOPR's weight (`topr_weight`), and the per-token metrics every loss logs
(`token_stats`, `by_turn`). loss.rl_loss composes them with the weights and clips of loss.py.

    python -m pytest -q tests/test_loss.py tests/test_distill.py      # against a dense fp64 reference
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from data import TokenSupport, entry_rows
from layers.masks import METRIC_CLAMP, Metrics, k3, stat, sum_by

MAX_TURN_METRICS = 8  # episodes' by-turn metrics cover the first 8 model turns (a turn's count 0: not logged)


@dataclass
class Rows:
    """The support entries of one micro-batch, each tied to its token."""

    row: Tensor  # int64 [nnz] token of each entry
    counts: Tensor  # int64 [T] entries per row
    u: Tensor  # [nnz] q_v (replayed) or 1/K (draws); 0 on rows outside the loss
    logp: Tensor  # [nnz] trainer log-prob, detached
    logq: Tensor  # [nnz] sampler log-prob; the trainer's own outside the loss

    def sum(self, x: Tensor) -> Tensor:
        """[T]: x summed over each row's entries."""
        return sum_by(self.row, x, self.counts.numel())


def rows(sup: TokenSupport, support_logp: Tensor, mask: Tensor) -> Rows:
    row = entry_rows(sup.offsets, support_logp.numel())
    counts = sup.offsets[1:] - sup.offsets[:-1]
    live = mask[row]
    logp = support_logp.detach()
    logq = torch.where(live, sup.logq.to(logp.dtype), logp)
    u = torch.where(sup.replayed[row], logq.exp(), 1.0 / counts[row].clamp(min=1).to(logp.dtype))
    return Rows(row, counts, torch.where(live, u, 0.0), logp, logq)


def by_turn(name: str, values: Tensor, mask: Tensor, turns: Tensor | None) -> Metrics:
    """`name/k`: the mean of `values` over the loss tokens of each model turn k (0-based) of an episode."""
    if turns is None:
        return {}
    return {f"{name}/{k}": stat(values, mask & (turns == k)) for k in range(MAX_TURN_METRICS)}


def token_stats(log_r: Tensor, entropy: Tensor, age: Tensor, mask: Tensor, turns: Tensor | None,
                 stale: bool, kl_on: bool, bound: int = 0) -> Metrics:
    """Entropy and the sampler mismatch; with --async-level also the mean age and KL(q||p) on age-0 tokens
    (k3; with --kl-coeff kl_term logs its estimator), telling engine mismatch from staleness. The
    synchronous loop leaves them out: every age is 0 there and kl/age0 would repeat mismatch/kl.
    --max-staleness S (`bound`): also the share of each age 0..S (engines/pipeline.py `AsyncRollouts.ages` reads them)."""
    out = {"entropy": stat(entropy.to(log_r.dtype), mask), "mismatch/kl": stat(k3(log_r), mask),
           "mismatch/abs_logratio": stat(log_r.clamp(-METRIC_CLAMP, METRIC_CLAMP).abs(), mask)}
    out.update(by_turn("by_turn/mismatch_kl", k3(log_r), mask, turns))
    if stale:  # --async-level > 0
        out["staleness/mean"] = stat(age, mask)
        if not kl_on:
            out["kl/age0"] = stat(k3(log_r), mask & (age == 0))
    out.update({f"staleness/frac/{k}": stat((age == k).to(log_r.dtype), mask) for k in range(bound + 1 if bound else 0)})
    return out


def kl_term(logp: Tensor, logq: Tensor, rows: Rows | None, support_logp: Tensor, age: Tensor, coeff: float,
             exact: bool, inv_sqrt: bool, mask: Tensor, metrics: Metrics) -> Tensor:
    """beta_t * KL_t(q||p): exact over the support row, or k1 on the sampled token; beta_t = coeff, or
    coeff / sqrt(1 + age) with `inv_sqrt` (--kl-staleness)."""
    kl = logq - logp
    if exact and rows is not None:
        kl = torch.where(rows.counts > 0, rows.sum(rows.u * (rows.logq - support_logp)), kl)
    beta = coeff * ((1 + age).rsqrt() if inv_sqrt else torch.ones_like(age))
    metrics.update({"kl": stat(kl, mask), "kl/beta": stat(beta, mask), "kl/age0": stat(kl, mask & (age == 0))})
    return beta * kl


def distill_term(logp: Tensor, teacher: tuple[Tensor, Tensor], rows: Rows | None, support_logp: Tensor,
                  sup: TokenSupport | None, adv: Tensor, coeff: float, exact: bool, mask: Tensor, metrics: Metrics) -> Tensor:
    """lambda * KL(p || t) per loss token as a score-function term, p the student (the trainer), t the teacher,
    both at the sampling temperature and renormalized alike over a replayed row (the same head):

        lambda * sum_{v in S} sg[omega_v * (log p(v) - log t(v))] * log p(v)

    k1: S = {a}, omega = 1 (the sampled token's log-ratio as a negative advantage). exact: S = the token's
    support row, omega_v = p(v) on a replayed row (the gradient of the exact KL over the kept set, since
    sum_S p grad log p = 0 there), p(v) / (K q(v)) on K draws from q (an unbiased estimate of the full
    KL's gradient). A token with an empty row, or a micro-batch with no support, takes k1.
    Logs distill/kl (sum_S omega*(log p - log t) per loss token) and distill/share, sum lambda*|KL| /
    sum (|A| + lambda*|KL|) over loss tokens: the distillation's share of the signal, 1 with --adv-tau 0."""
    assert teacher is not None, "--distill-coeff > 0 needs the teacher's log-probs (train.teacher_logprobs)"
    t_logp, t_support_logp = teacher
    t_logp = torch.where(mask, t_logp.to(logp.dtype), logp.detach())  # ratio 1 outside the loss
    kl = logp.detach() - t_logp
    term = kl * logp
    if exact and rows is not None:
        live, k = mask[rows.row], rows.counts[rows.row].clamp(min=1).to(logp.dtype)
        log_w = torch.where(sup.replayed[rows.row], rows.logp, rows.logp - rows.logq - k.log())
        coef = torch.where(live, log_w, -math.inf).exp() * torch.where(live, rows.logp - t_support_logp.to(logp.dtype), 0.0)
        has_row = rows.counts > 0
        kl, term = torch.where(has_row, rows.sum(coef), kl), torch.where(has_row, rows.sum(coef * support_logp), term)
    size = coeff * kl.abs()
    metrics["distill/kl"] = stat(kl, mask)
    metrics["distill/share"] = (torch.where(mask, size, 0.0).sum(), torch.where(mask, adv.abs() + size, 0.0).sum())
    return coeff * term


def sapo_gate(log_rho: Tensor, adv: Tensor, tau_pos: float, tau_neg: float, mask: Tensor, metrics: Metrics) -> Tensor:
    """SAPO (arXiv 2511.20347): f(rho) = (4/tau)*sigmoid(tau*(rho - 1)), tau = tau_pos where A > 0, else tau_neg.
    Its gradient 4*s*(1 - s)*rho*grad log p is the plain policy gradient at rho = 1 and fades smoothly off it
    (logged: the mean of 4*s*(1 - s)). rho is capped at e^20, where s = 1 exactly: an overflowing ratio
    gets gradient 0, never inf*0."""
    tau = torch.full_like(adv, tau_neg).masked_fill(adv > 0, tau_pos)  # in adv's dtype: where() of two floats is fp32
    x = tau * (log_rho.clamp(max=METRIC_CLAMP).exp() - 1)
    s = torch.nn.functional.logsigmoid(x).exp()  # its backward reads sigmoid(-x) itself, never 1 - s: exact as s -> 1
    metrics["sapo/gate_weight"] = stat(4 * s * torch.sigmoid(-x), mask)
    return 4 / tau * s


def topr_weight(lp: Tensor, logq: Tensor, adv: Tensor, doc_ids: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """TOPR's detached weight (1, or min(1, prod of the sequence's p/q) where A < 0) and where that min truncates.
    The product is a sum of log r capped at 0 before exp: it never overflows."""
    log_seq = sum_by(doc_ids, torch.where(mask, lp - logq, 0.0), len(doc_ids))[doc_ids]
    return torch.where(adv < 0, log_seq.clamp(max=0).exp(), 1.0), mask & (adv < 0) & (log_seq > 0)
