"""The RL loss: one policy-gradient estimator with nine weightings, sequence and KL masks, score
centering, a sampler KL, global normalization and metrics (the evidence it reads is checked
first, in run/evidence.py).
docs/design.md "The loss" writes it out in full, with the table of corrections;
tests/test_loss.py checks every path against a dense fp64 reference written from the formula:

    loss_t = -A_t * ( w(a)*log p(a) - sum_{v in S_t} sg[u_v*w(v)]*log p(v) ) + beta_t*KL_t

A_t is the advantage times --adv-tau and w is detached: a weight of r = p/q for reinforce,
icepop, ipo and tis, the four that get score centering (the sum over the support S_t: u_v = q_v
on a replayed top-p/top-k row, 1/K on K draws); sg(clip(rho))*M(k) for cispo, rho = p/pi_old;
ppo keeps its surrogate -M(k)*min(rho*A, clip(rho)*A), and gspo the same with rho replaced by
its sequence's s = exp(mean of log rho); sapo swaps the clip for SAPO's soft gate on rho. M(k) is
IcePop's mask on k = pi_old/q (with --icepop). topr is uncentered: w = 1 where A >= 0, the
sequence's p/q truncated to 1 where A < 0. --seq-mask and --kl-mask (DPPO's directional form
too) and --m2po-threshold (M2PO: the step's largest (log pi_old/q)^2, its bound found before the
first backward) zero every w of a sequence or token, centering included; --log-ratio-coeff adds
tau*(log r)^2 (Kimi K2.5) on the ratio the loss reads. --teacher adds
lambda * sum_v sg[omega_v*(log p(v) - log t(v))] * log p(v), on-policy distillation (`terms.distill_term`).

Simplifications and decisions:
1. Everything is in log space. Masks are decided on log r = log p - log q and the weight
   is exp(log r) only where the mask keeps it (exp(-inf) = 0 elsewhere), so a ratio that
   overflows contributes exactly 0 to the loss and its gradient, never inf*0 = NaN. A
   sequence's ratio is the geometric mean exp(mean log r); a raw product would overflow (topr's
   product is capped at 1 in log space first).
2. Positions outside the loss (prompt, padding, dropped samples) read the trainer's own log-prob
   as their evidence: ratio 1, weight finite, coefficient 0; garbage there cannot reach a gradient.
3. Metrics and KL masks clamp log r to +-20 (e^20 ~ 5e8), so k3, chi^2 and mask_tv stay finite.
4. KL exact falls back to k1 on a token whose support row is empty, and everywhere when
   the micro-batch has no support. Age is clamped at 0.
5. A sequence is a document of the micro-batch (packing never splits a sample).
6. Sequence and KL masks judge r = p/q, or k = pi_old/q for ppo/cispo/gspo/sapo (the directional
   form's "further" too), and leave the sampler KL and the (log r)^2 term alone: regularizers,
   not corrections. k1 is signed, so its mask reads |log r|; binary is KL(Bernoulli(q(a)) ||
   Bernoulli(p(a))), binary_tv their TV |p(a) - q(a)|.
7. Denominators count the micro-batches they are given with one host sync, before the loop;
   under torchrun train.prepare gives them the whole gathered batch, so they are global with
   no collective. A zero count divides by 1 (loss 0).
8. ppo has no dual clip: rho compares the trainer with itself and stays near 1.

    python -m pytest -q tests/test_loss.py      # CPU, seconds
    python train.py --loss tis --seq-mask geometric --seq-mask-low 0.999 --seq-mask-high 1.001   # 1 CPU or GPU
    torchrun --nproc_per_node 8 train.py --model <HF dir> --loss ppo --icepop     # N GPUs
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from config import Config, ConfigError, FP32_MAX
from data import MicroBatch, TokenSupport, truncated
from layers import terms
from layers.masks import (METRIC_CLAMP, Masks, Metrics, any_by, keep_mask, kl_flags, outside, seq_flags, stat,
    sum_by)


@dataclass(frozen=True)
class Check:
    """A range check on flags a loss reads: `ok(*their values)`, else the line `--a/--b message`, the
    message formatted with the values by field name."""

    flags: tuple[str, ...]
    ok: Callable[..., bool]
    message: str


@dataclass(frozen=True)
class Loss:
    """A --loss, said once: its weight or term, the flags it reads and their checks, and what the rest
    of floe needs from it. train.py, the head's sparse backward, the evidence checks, the start checks
    (`check_flags`, start.unread) and --correction-metrics-only ask this table, never the loss's name."""

    centered: bool  # a weight w(r) = f(p/q) with score centering: reads every loss token's support row
    sparse_draws: bool  # under K draws its gradient lies on label and support rows only (G_t = 0, kernels.py)
    clipped: bool  # clipped against pi_old: with --epochs > 1 train.py computes pi_old before the first pass
    reads: tuple[str, ...] = ()  # its own flags (Config fields), in the order `weight` takes them; with another --loss nothing reads them
    checks: tuple[Check, ...] = ()  # their range checks; a float flag is also checked finite, unless in `no_cap`
    no_cap: tuple[str, ...] = ()  # its flags whose inf means "no cap"
    weight: Callable | None = None  # centered: (log p, log q, *flags) -> (w, outside low, outside high), detached
    bound: str = ""  # what its bounds do to a token, for the metric's name: "mask" (masked_fraction), "clip" (clip_fraction)
    sides: bool = True  # its metric also reports the low and the high side
    sequence_ratio: bool = False  # clipped: one ratio per sequence, exp(mean of log rho) (gspo)
    weighted_log_p: bool = False  # clipped: sg(clip(rho)) * log p (cispo) instead of ppo's min(rho A, clip(rho) A)
    soft_gate: bool = False  # clipped: SAPO's gate (4/tau)*sigmoid(tau*(rho - 1)) in place of the clip; reads its taus
    tapered: bool = False  # neither: TOPR's -A*w*log p, w = 1 where A >= 0, sg(min(1, the sequence's p/q)) where A < 0


def icepop_weight(logp: Tensor, logq: Tensor, alpha: float, beta: float):
    """IcePop's M: weight r inside [alpha, beta] (inclusive), 0 outside."""
    log_r = logp - logq
    low, high, _, _ = outside(log_r, alpha, beta)
    return torch.where(low | high, -math.inf, log_r).exp(), low, high


def ipo_weight(logp: Tensor, logq: Tensor, eps: float, cap: float):
    """r capped at `cap`, 0 where |p - q| > eps."""
    drop = (logp.exp() - logq.exp()).abs() > eps
    capped = (logp - logq).clamp(max=math.log(cap))
    low = drop & (logp < logq)
    return torch.where(drop, -math.inf, capped).exp(), low, drop & ~low


def tis_weight(logp: Tensor, logq: Tensor, cap: float, floor: float):
    """Truncated importance sampling: r clamped to [floor, cap]."""
    log_r = logp - logq
    low, high, lo, hi = outside(log_r, floor, cap)
    return log_r.clamp(lo, hi).exp(), low, high


def unit_weight(logp: Tensor, logq: Tensor):
    none = torch.zeros_like(logp, dtype=torch.bool)
    return torch.ones_like(logp), none, none


ICEPOP = ("icepop_alpha", "icepop_beta")
ICEPOP_CHECKS = (Check(ICEPOP, lambda a, b: 0 <= a < b, "need 0 <= alpha < beta, got alpha={icepop_alpha} beta={icepop_beta}"),)
CLIP = ("clip_low", "clip_high", "icepop_mask")  # with --icepop-mask a clipped loss also reads icepop's bounds
CLIP_CHECKS = (Check(("clip_low",), lambda low: 0 <= low < 1, "must be in [0, 1), got {clip_low}"),
               Check(("clip_high",), lambda high: high >= 0, "must be >= 0, got {clip_high}"))
LOSSES = {
    "reinforce": Loss(centered=True, sparse_draws=True, clipped=False, weight=unit_weight),  # w = 1
    "icepop": Loss(centered=True, sparse_draws=False, clipped=False, reads=ICEPOP, checks=ICEPOP_CHECKS,
                   weight=icepop_weight, bound="mask"),
    "ipo": Loss(centered=True, sparse_draws=False, clipped=False, reads=("ipo_eps", "max_importance_ratio"),
                checks=(Check(("ipo_eps",), lambda eps: eps > 0, "must be > 0, got {ipo_eps}"),
                        Check(("max_importance_ratio",), lambda cap: cap >= 1, "must be >= 1, got {max_importance_ratio}")),
                no_cap=("max_importance_ratio",), weight=ipo_weight, bound="mask", sides=False),
    "tis": Loss(centered=True, sparse_draws=False, clipped=False, reads=("tis_cap", "tis_floor"),
                checks=(Check(("tis_floor", "tis_cap"), lambda floor, cap: 0 <= floor <= 1 <= cap,
                              "need 0 <= floor <= 1 <= cap, got floor={tis_floor} cap={tis_cap}"),),
                no_cap=("tis_cap",), weight=tis_weight, bound="clip"),
    "ppo": Loss(centered=False, sparse_draws=False, clipped=True, reads=CLIP, checks=CLIP_CHECKS),  # min(rho*A, clip(rho)*A)
    "cispo": Loss(centered=False, sparse_draws=False, clipped=True, reads=CLIP, checks=CLIP_CHECKS,  # sg(clip(rho)) * log p
                  weighted_log_p=True),
    "gspo": Loss(centered=False, sparse_draws=False, clipped=True, reads=CLIP, checks=CLIP_CHECKS,  # ppo's clip on the
                 sequence_ratio=True),  # sequence's mean ratio
    "sapo": Loss(centered=False, sparse_draws=False, clipped=True, reads=("sapo_tau_pos", "sapo_tau_neg", "icepop_mask"),
                 checks=(Check(("sapo_tau_pos", "sapo_tau_neg"), lambda pos, neg: pos > 0 and neg > 0,
                               "need both > 0, got pos={sapo_tau_pos} neg={sapo_tau_neg}"),), soft_gate=True),
    "topr": Loss(centered=False, sparse_draws=False, clipped=False, bound="clip", sides=False, tapered=True),
}


def check_flags(cfg: Config) -> None:
    """Every loss's flags in range, whichever --loss runs (a sweep keeps one set of flags), at the start
    checks: config.py sits below this table, so it cannot ask it. One ConfigError naming the flag."""
    for loss in LOSSES.values():
        for f in loss.reads:
            v = getattr(cfg, f)
            flag = f"--{f.replace('_', '-')}"
            if type(v) is float and f not in loss.no_cap and not (math.isfinite(v) and abs(v) <= FP32_MAX):
                raise ConfigError(f"{flag} must be a finite number" + (f" in float32 (at most {FP32_MAX:.1e})" * math.isfinite(v))
                                  + f", got {v:g}")
        for c in loss.checks:
            if not c.ok(*(getattr(cfg, f) for f in c.flags)):
                flags = "/".join(f"--{f.replace('_', '-')}" for f in c.flags)
                raise ConfigError(f"{flags} {c.message.format(**{f: getattr(cfg, f) for f in c.flags})}")


def flag_values(loss: Loss, cfg: Config) -> tuple:
    return tuple(getattr(cfg, f) for f in loss.reads)


def bound_name(name: str) -> str:
    """The metric key of a loss's bounds: `icepop/masked_fraction`, `tis/clip_fraction`."""
    return f"{name}/{'clip' if LOSSES[name].bound == 'clip' else 'masked'}_fraction"


def trained(cfg: Config) -> Loss:
    """The loss a config trains (--correction-metrics-only: plain reinforce)."""
    return LOSSES["reinforce" if cfg.correction_metrics_only else cfg.loss]


def reads(cfg: Config) -> set[str]:
    """The LOSSES flags this config's loss reads: its own (with --icepop-mask a clipped loss's include
    icepop's bounds); under --correction-metrics-only every correction's bounds, which it reports."""
    if cfg.stage == "sft":
        return set()
    if cfg.correction_metrics_only:
        return {f for loss in LOSSES.values() if loss.centered for f in loss.reads}
    own = set(LOSSES[cfg.loss].reads)
    return own | set(ICEPOP) if LOSSES[cfg.loss].clipped and cfg.icepop_mask else own


def reads_support(cfg: Config) -> bool:
    """Whether the engine must report each token's support. Score centering and the exact KLs (to the
    sampler, to a --teacher) read it; truncated sampling always reports its kept set, whatever the loss, because the trainer's p
    is renormalized over it: otherwise log p - log q would be off by the log of the trainer's mass
    on the kept set, which is no mismatch."""
    return (truncated(cfg.top_p, cfg.top_k) or trained(cfg).centered or (cfg.kl_coeff > 0 and cfg.kl_estimator == "exact")
            or distills_exact(cfg))


def sparse_ok(cfg: Config, support: TokenSupport | None) -> bool:
    """Whether the head may take its sparse backward (kernels.head(..., sparse=True)).

    Decided from the config alone (the replayed flags live on the device): truncated sampling
    gives replayed rows, where every loss and KL is exact; K draws are exact only for a loss
    whose weights are 1 (`sparse_draws`) and no KL (to the sampler or to a --teacher). --seq-mask/--kl-mask
    zero a token's whole policy term, centering included, so G_t stays 0 under them. Assumes every loss token carries
    its row (Sampling(support=True)): an empty draws row on a loss token needs the dense path."""
    if support is None:
        return False
    return truncated(cfg.top_p, cfg.top_k) or (trained(cfg).sparse_draws and cfg.kl_coeff == 0 and cfg.distill_coeff == 0)


def group_advantages(rewards: list[float], group_size: int, std_norm: bool = False) -> list[float]:
    """A = r - mean(group) (/ std(group) with std_norm); groups are consecutive. A NaN
    reward (a skipped sample) is left out of its group's statistics and gets A = 0."""
    r = torch.tensor(rewards, dtype=torch.float64).view(-1, group_size)
    ok = r.isfinite()
    n = ok.sum(1, keepdim=True).clamp(min=1)
    mean = torch.where(ok, r, 0.0).sum(1, keepdim=True) / n
    a = torch.where(ok, r - mean, 0.0)
    if std_norm:
        std = (a.pow(2).sum(1, keepdim=True) / n).sqrt()
        a = a / (std + 1e-6)
    return a.flatten().tolist()


@dataclass
class Denominators:
    tokens: int  # loss tokens in the global batch, masked-by-weight tokens included
    seqs: int  # sequences with >= 1 loss token in the global batch
    m2_max: float = math.inf  # --m2po-threshold: the largest (log pi_old/q)^2 a loss token may keep (m2po_bound)

    def tensors(self, device) -> Denominators:
        """The three as 0-d tensors on `device`, for a compiled loss (train.micro_loss): a Python number's
        value is a guard there, a new graph for every count (m2_max in the log-probs' fp32, as eager compares)."""
        return Denominators(*(torch.tensor(x, dtype=d, device=device) for x, d in
                              ((self.tokens, torch.int64), (self.seqs, torch.int64), (self.m2_max, torch.float32))))


def _at_least_one(n: int | Tensor) -> int | Tensor:
    """A count to divide by: a zero count divides by 1 (loss 0), a Python int or a 0-d tensor alike."""
    return n.clamp(min=1) if isinstance(n, Tensor) else max(n, 1)


def denominators(micro_batches: list[MicroBatch]) -> Denominators:
    """Counted from loss_mask, so samples dropped by evidence.validate leave both counts."""
    if not micro_batches:
        return Denominators(0, 0)
    counts = [torch.stack([mb.loss_mask.sum(), any_by(mb.doc_ids, mb.loss_mask, mb.loss_mask.numel()).sum()])
              for mb in micro_batches]
    tokens, seqs = torch.stack(counts).sum(0).tolist()  # the one host sync, before the loop
    return Denominators(int(tokens), int(seqs))


def _would_mask(lp: Tensor, logq: Tensor, adv: Tensor, doc_ids: Tensor, mask: Tensor, cfg: Config) -> Metrics:
    """--correction-metrics-only: the share of loss tokens each bounded centered loss (LOSSES: icepop,
    ipo; tis and topr as a clip) and each mask would remove with the current bounds, the mean ratio,
    chi^2 = E[r^2] - 1 and ESS/n per sequence."""
    flags = {name + "_clip" * (loss.bound == "clip"): mask & torch.stack(loss.weight(lp, logq, *flag_values(loss, cfg))[1:]).any(0)
             for name, loss in LOSSES.items() if loss.centered and loss.bound}
    flags["topr_clip"] = terms.topr_weight(lp, logq, adv, doc_ids, mask)[1]
    m = Masks.of(cfg)
    flags |= seq_flags(lp, logq, doc_ids, mask, m) | kl_flags(lp, logq, adv, doc_ids, mask, m)
    out = {f"correction/would_mask/{k}": stat(v.to(lp.dtype), mask) for k, v in flags.items()}
    r = (lp - logq).clamp(-METRIC_CLAMP, METRIC_CLAMP).exp()
    x = torch.stack([torch.ones_like(r), r, r * r], 1) * mask[:, None]  # r is finite: a product is safe
    n, s1, s2 = sum_by(doc_ids, x, len(x)).unbind(1)  # per sequence
    out["correction/ratio"], out["correction/chi2"] = stat(r, mask), stat(r * r - 1, mask)
    out["correction/ess"] = stat(s1 * s1 / (n * s2), n > 0)  # (sum r)^2 / (n sum r^2), per sequence
    return out


# ----------------------------------------------------------------------------- metrics

def _masked_stats(name: str, low: Tensor, high: Tensor, mask: Tensor, dtype: torch.dtype,
                  turns: Tensor | None = None) -> Metrics:
    """Fractions of loss tokens a loss's bounds removed (or clipped: `Loss.bound`); the count is every loss
    token, never 1 - mean. With `turns` (episodes) also by model turn: whether later turns drift."""
    key = bound_name(name)
    out = {key: stat((low | high).to(dtype), mask)}
    if LOSSES[name].sides:
        out[f"{key}/low"], out[f"{key}/high"] = stat(low.to(dtype), mask), stat(high.to(dtype), mask)
    out.update(terms.by_turn(f"by_turn/{key.replace('/', '_')}", (low | high).to(dtype), mask, turns))
    return out


# ----------------------------------------------------------------------------- the loss terms

def _centered_term(logp: Tensor, logq: Tensor, adv: Tensor, rows: terms.Rows | None, support_logp: Tensor, name: str,
                   bounds: tuple, keep: Tensor, mask: Tensor, metrics: Metrics, turns: Tensor | None = None) -> Tensor:
    """reinforce/icepop/ipo/tis: -A*(w(a)*log p(a) - sum_v sg[u_v*w(v)]*log p(v)), w = 0 off `keep`;
    `bounds`: the flags LOSSES[name].weight reads."""
    weight = LOSSES[name].weight
    w, low, high = weight(logp.detach(), logq, *bounds)
    if LOSSES[name].bound:
        metrics.update(_masked_stats(name, low, high, mask, logp.dtype, turns))
    score = torch.where(keep, w, 0.0) * logp
    if rows is not None:
        wv = torch.where(keep[rows.row], weight(rows.logp, rows.logq, *bounds)[0], 0.0)
        score = score - rows.sum((rows.u * wv).detach() * support_logp)
        r = (rows.logp - rows.logq).clamp(-METRIC_CLAMP, METRIC_CLAMP).exp()
        centered = mask & (rows.counts > 0)
        metrics["score_centering/support_mass"] = stat(rows.sum(rows.u * r), centered)
        metrics["score_centering/mask_tv"] = stat(0.5 * rows.sum(rows.u * (r - wv).abs()), centered)
    return -adv * score


def _clipped_term(logp: Tensor, logq: Tensor, adv: Tensor, old: Tensor, doc_ids: Tensor, loss: Loss, clip: tuple,
                  icepop: tuple | None, keep: Tensor, mask: Tensor, metrics: Metrics, turns: Tensor | None) -> Tensor:
    """ppo/cispo/gspo: the clip on rho = p/pi_old to [1 - clip[0], 1 + clip[1]], times M(k), k = pi_old/q,
    when `icepop` gives its bounds (--icepop-mask); 0 off `keep`. sapo: SAPO's gate in place of the clip
    (`clip` holds its taus). A sequence ratio (gspo) is exp(mean of log p/pi_old over the tokens M keeps), with grad."""
    # Which tokens M keeps is decided in log space, never from M > 0 after exp: with --icepop-alpha 0
    # a kept k = e^-200 underflows to 0 in fp32 but stays in gspo's mean and ppo's M*rho.
    on, log_m = keep, torch.zeros_like(logp)  # keep: False where a sequence or KL mask removes the token
    if icepop is not None:
        _, low, high = icepop_weight(old, logq, *icepop)
        on, log_m = on & ~(low | high), old - logq
        metrics.update(_masked_stats("icepop", low, high, mask, logp.dtype, turns))
    log_m = torch.where(on, log_m, -math.inf)
    m = log_m.exp()
    log_rho = logp - old
    if loss.soft_gate:
        return -adv * m * terms.sapo_gate(log_rho, adv, *clip, mask, metrics)
    lo, hi = math.log1p(-clip[0]), math.log1p(clip[1])
    if loss.sequence_ratio:  # one ratio per sequence (a document of the micro-batch)
        mean_of = mask & on
        x = torch.stack([mean_of.to(logp.dtype), torch.where(mean_of, log_rho, 0.0)], 1)
        n, total = sum_by(doc_ids, x, len(x)).unbind(1)
        log_rho = (total / n.clamp(min=1))[doc_ids]
    clipped_rho = log_rho.detach().clamp(lo, hi).exp()
    if loss.weighted_log_p:
        clipped = (log_rho < lo) | (log_rho > hi)
        term = -adv * (m * clipped_rho) * logp
    else:
        # min(rho*A, clip(rho)*A) picks the constant only on the side the update pushes out
        clipped = ((adv > 0) & (log_rho > hi)) | ((adv < 0) & (log_rho < lo))
        live = ~clipped & on
        # M*rho as one exp: no exp of a masked ratio, even in backward, and a kept M that underflows
        # alone cannot zero its product with a large rho (fp32 and fp64 agree)
        m_rho = torch.where(live, log_m + log_rho, -math.inf).exp()
        term = -adv * torch.where(clipped, m * clipped_rho, m_rho)
    metrics["ppo/clip_fraction"] = stat(clipped.to(logp.dtype), mask)
    return term


def _topr_term(logp: Tensor, logq: Tensor, adv: Tensor, doc_ids: Tensor, keep: Tensor, mask: Tensor,
               metrics: Metrics, turns: Tensor | None) -> Tensor:
    """TOPR (arXiv 2503.14286): -A*w*log p(a), w = 1 on a sequence with A >= 0 (its plain log-likelihood) and
    sg(min(1, p(y)/q(y))) with A < 0, y the whole sequence; no centering, 0 off `keep`."""
    w, clipped = terms.topr_weight(logp.detach(), logq, adv, doc_ids, mask)
    metrics.update(_masked_stats("topr", clipped, torch.zeros_like(clipped), mask, logp.dtype, turns))
    return -adv * torch.where(keep, w, 0.0) * logp


def distills_exact(cfg: Config) -> bool:
    """--distill-estimator exact is on: the teacher's KL reads every loss token's support row."""
    return cfg.distill_coeff > 0 and cfg.distill_estimator == "exact"


def _normalization(mb: MicroBatch, agg: str, denom: Denominators, dtype: torch.dtype) -> tuple[Tensor, Tensor, int | Tensor]:
    """Per-token coefficient of the global loss (--loss-agg token or sequence); (coef, this micro-batch's
    count, global count)."""
    f = mb.loss_mask.to(dtype)
    if agg == "token":
        return f / _at_least_one(denom.tokens), f.sum(), _at_least_one(denom.tokens)
    per_doc, d = sum_by(mb.doc_ids, f, f.numel()), _at_least_one(denom.seqs)
    return f / (per_doc[mb.doc_ids].clamp(min=1) * d), (per_doc > 0).sum().to(dtype), d


def rl_loss(logp: Tensor, support_logp: Tensor, entropy: Tensor, mb: MicroBatch, cfg: Config,
            denom: Denominators, step: int | Tensor, old_logp: Tensor | None = None,
            teacher: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Metrics]:
    """This micro-batch's share of the global loss, and its (sum, count) metrics; no host sync. The flags
    are read here, once; the terms below get the values they use.

    logp [T] and support_logp [nnz] carry grad (renormalized over the row where replayed);
    entropy [T] is a metric; old_logp [T] is pi_old for ppo/cispo (None: sg(logp)); `teacher` (--teacher) is
    the teacher's (logp [T], support_logp [nnz]) from the same head on the same micro-batch, no grad."""
    mask, lp = mb.loss_mask, logp.detach()
    adv = torch.where(mask, mb.advantages.to(lp.dtype), 0.0) * cfg.adv_tau
    logq = torch.where(mask, mb.logq.to(lp.dtype), lp)
    age = (step - mb.versions).clamp(min=0).to(lp.dtype)  # a token carries the version that drew it (engines/torch_engine.py); step may be 0-d
    turns = mb.turns if cfg.env else None  # episodes: the mismatch and the masks by model turn too
    metrics = terms.token_stats(lp - logq, entropy, age, mask, turns, cfg.async_level > 0 or cfg.max_staleness > 0,
                           cfg.kl_coeff > 0, cfg.max_staleness)
    name, masks = cfg.loss, Masks.of(cfg)
    if cfg.correction_metrics_only:  # plain reinforce; the corrections only say what they would mask
        metrics.update(_would_mask(lp, logq, adv, mb.doc_ids, mask, cfg))
        name, masks = "reinforce", Masks()
    loss = LOSSES[name]
    start = lp if old_logp is None else torch.where(mask, old_logp.detach().to(lp.dtype), lp)  # p at the step's start
    old = start if loss.clipped else lp
    keep = keep_mask(old, logq, adv, mb.doc_ids, mask, masks, metrics)  # judges p/q, or pi_old/q for ppo/cispo
    if cfg.m2po_threshold > 0:  # M2PO: the step's bound, found before the first backward (m2po_bound)
        drop = mask & ((start - logq) ** 2 > denom.m2_max)
        metrics["correction/would_mask/m2po" if cfg.correction_metrics_only else "m2po/masked_fraction"] = \
            stat(drop.to(lp.dtype), mask)
        keep = keep if cfg.correction_metrics_only else keep & ~drop
    exact = cfg.kl_estimator == "exact"
    reads_rows = loss.centered or cfg.kl_coeff > 0 and exact or distills_exact(cfg)
    rows = terms.rows(mb.support, support_logp, mask) if mb.support is not None and reads_rows else None
    if loss.centered:
        per_token = _centered_term(logp, logq, adv, rows, support_logp, name, flag_values(loss, cfg), keep, mask, metrics, turns)
    elif loss.tapered:
        per_token = _topr_term(logp, logq, adv, mb.doc_ids, keep, mask, metrics, turns)
    else:  # ppo/cispo/gspo read their clip, sapo its taus: the first two flags of `reads`
        icepop = (cfg.icepop_alpha, cfg.icepop_beta) if cfg.icepop_mask else None
        per_token = _clipped_term(logp, logq, adv, old, mb.doc_ids, loss, flag_values(loss, cfg)[:2], icepop, keep,
                                  mask, metrics, turns)
    if cfg.log_ratio_coeff > 0:  # Kimi K2.5's tau*(log r)^2 on the ratio the loss reads; never masked, like the KL
        log_r = logp - (old if loss.clipped else logq)
        metrics["log_ratio_sq"] = stat(log_r * log_r, mask)
        per_token = per_token + cfg.log_ratio_coeff * log_r * log_r
    if cfg.kl_coeff > 0:  # never masked: a regularizer, not a correction
        per_token = per_token + terms.kl_term(logp, logq, rows, support_logp, age, cfg.kl_coeff, exact,
                                         cfg.kl_staleness == "inv_sqrt", mask, metrics)
    if cfg.distill_coeff > 0:  # never masked: an objective of its own, on the student's own tokens
        per_token = per_token + terms.distill_term(logp, teacher, rows, support_logp, mb.support, adv, cfg.distill_coeff,
                                              distills_exact(cfg), mask, metrics)
    coef, count, d = _normalization(mb, cfg.loss_agg, denom, lp.dtype)
    loss_value = (coef * torch.where(mask, per_token, 0.0)).sum()
    metrics["loss"] = (loss_value.detach() * d, count)
    return loss_value, metrics


def sft_loss(logp: Tensor, mb: MicroBatch, denom: Denominators) -> tuple[Tensor, Metrics]:
    """Supervised warm-up: mean negative log-likelihood over the global batch's loss tokens."""
    nll = torch.where(mb.loss_mask, -logp, 0.0)
    return nll.sum() / _at_least_one(denom.tokens), {"loss": (nll.detach().sum(), mb.loss_mask.sum().to(logp.dtype))}
