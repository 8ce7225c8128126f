"""The RL loss: one policy-gradient estimator with six weightings, sequence and KL masks, score
centering, a sampler KL, global normalization, metrics, and the sampler-evidence checks.
docs/design.md "The loss" writes it out in full and README.md "The loss" tabulates the corrections;
tests/test_loss.py checks every path against a dense fp64 reference written from the formula:

    loss_t = -A_t * ( w(a)*log p(a) - sum_{v in S_t} sg[u_v*w(v)]*log p(v) ) + beta_t*KL_t

A_t is the advantage times --adv-tau and w is detached: a weight of r = p/q for reinforce,
icepop, ipo and tis, the four that get score centering (the sum over the support S_t: u_v = q_v
on a replayed top-p/top-k row, 1/K on K draws); sg(clip(rho))*M(k) for cispo, rho = p/pi_old;
ppo keeps its surrogate -M(k)*min(rho*A, clip(rho)*A). M(k) is IcePop's mask on k = pi_old/q
(with --icepop). --seq-mask and --kl-mask zero every w of a sequence or token, centering included.

Simplifications and decisions:
1. Everything is in log space. Masks are decided on log r = log p - log q and the weight
   is exp(log r) only where the mask keeps it (exp(-inf) = 0 elsewhere), so a ratio that
   overflows contributes exactly 0 to the loss and its gradient, never inf*0 = NaN. A
   sequence's ratio is the geometric mean exp(mean log r); a raw product would overflow.
2. Positions outside the loss (prompt, padding, dropped samples) read the trainer's own log-prob
   as their evidence: ratio 1, weight finite, coefficient 0; garbage there cannot reach a gradient.
3. Metrics and KL masks clamp log r to +-20 (e^20 ~ 5e8), so k3, chi^2 and mask_tv stay finite.
4. KL exact falls back to k1 on a token whose support row is empty, and everywhere when
   the micro-batch has no support. Age is clamped at 0.
5. A sequence is a document of the micro-batch (packing never splits a sample).
6. Sequence and KL masks judge r = p/q, or k = pi_old/q for ppo/cispo, and leave the sampler
   KL alone: beta*KL is a regularizer, not a correction. k1 is signed, so its mask reads
   |log r|; binary is KL(Bernoulli(q(a)) || Bernoulli(p(a))).
7. Denominators count the micro-batches they are given with one host sync, before the loop;
   under torchrun train.prepare gives them the whole gathered batch, so they are global with
   no collective. A zero count divides by 1 (loss 0).
8. ppo has no dual clip: rho compares the trainer with itself and stays near 1.
9. Evidence checks read the loss tokens and their support rows only (what the loss uses).
   An empty replayed row fails (it cannot hold its sampled token); an empty draws row fails on
   a trained token for the centered losses (their centering reads it, and the sparse backward
   is exact only with it) and is fine for ppo/cispo. Broken offsets, a packing bug, raise even
   under --bad-evidence drop.

    python -m pytest -q tests/test_loss.py      # CPU, seconds
    python train.py --loss tis --seq-mask geometric --seq-mask-low 0.999 --seq-mask-high 1.001   # 1 CPU or GPU
    torchrun --nproc_per_node 8 train.py --model <HF dir> --loss ppo --icepop     # N GPUs
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from config import Config
from data import MicroBatch, RunError, TokenSupport

Metrics = dict[str, tuple[Tensor, Tensor]]
CENTERED = ("reinforce", "icepop", "ipo", "tis")  # the weightings w(r) that get score centering
METRIC_CLAMP = 20.0  # |log r| cap for metrics and KL masks only


def _sum_by(idx: Tensor, x: Tensor, size: int) -> Tensor:
    """[size, ...]: the sum of x's entries with each index (index_add, no host sync)."""
    return x.new_zeros((size, *x.shape[1:])).index_add(0, idx, x)


def _any_by(idx: Tensor, flags: Tensor, size: int) -> Tensor:
    """[size] bool: OR of `flags` over the entries with each index."""
    return _sum_by(idx, flags.long(), size) > 0


@dataclass
class Denominators:
    tokens: int  # loss tokens in the global batch, masked-by-weight tokens included
    seqs: int  # sequences with >= 1 loss token in the global batch


def denominators(micro_batches: list[MicroBatch]) -> Denominators:
    """Counted from loss_mask, so samples dropped by validate_evidence leave both counts."""
    if not micro_batches:
        return Denominators(0, 0)
    counts = [torch.stack([mb.loss_mask.sum(), _any_by(mb.doc_ids, mb.loss_mask, mb.loss_mask.numel()).sum()])
              for mb in micro_batches]
    tokens, seqs = torch.stack(counts).sum(0).tolist()  # the one host sync, before the loop
    return Denominators(int(tokens), int(seqs))


# ----------------------------------------------------------------------------- weights

def _outside(log_r: Tensor, low: float, high: float) -> tuple[Tensor, Tensor, float, float]:
    """(log r < log low, log r > log high, log low, log high); inclusive bounds, low = 0: none."""
    lo, hi = (math.log(low) if low > 0 else -math.inf), math.log(high)
    return log_r < lo, log_r > hi, lo, hi


def _weight(logp: Tensor, logq: Tensor, loss: str, cfg: Config) -> tuple[Tensor, Tensor, Tensor]:
    """w for a centered --loss, or icepop's for M(k), from detached log-probs; (w, masked or clipped low, high)."""
    log_r = logp - logq
    if loss == "icepop":  # IcePop's M: weight r inside [alpha, beta] (inclusive), 0 outside
        low, high, _, _ = _outside(log_r, cfg.icepop_alpha, cfg.icepop_beta)
        return torch.where(low | high, -math.inf, log_r).exp(), low, high
    if loss == "ipo":
        drop = (logp.exp() - logq.exp()).abs() > cfg.ipo_eps
        capped = log_r.clamp(max=math.log(cfg.max_importance_ratio))
        low = drop & (logp < logq)
        return torch.where(drop, -math.inf, capped).exp(), low, drop & ~low
    if loss == "tis":  # truncated importance sampling, with an optional floor
        low, high, lo, hi = _outside(log_r, cfg.tis_floor, cfg.tis_cap)
        return log_r.clamp(lo, hi).exp(), low, high
    none = torch.zeros_like(log_r, dtype=torch.bool)
    return torch.ones_like(log_r), none, none


# ----------------------------------------------------------------------------- sequence and KL masks

def _seq_flags(logp: Tensor, logq: Tensor, mb: MicroBatch, cfg: Config, mask: Tensor) -> dict[str, Tensor]:
    """Loss tokens of the sequences each --seq-mask removes: the geometric mean of the ratios
    (a mean in log space, finite at any length), or any one ratio, outside [low, high]."""
    log_r = logp - logq
    x = torch.stack([mask.to(log_r.dtype), torch.where(mask, log_r, 0.0)], 1)
    n, total = _sum_by(mb.doc_ids, x, len(x)).unbind(1)  # per sequence
    geo = _outside((total / n.clamp(min=1))[mb.doc_ids], cfg.seq_mask_low, cfg.seq_mask_high)
    worst = _outside(log_r, cfg.seq_mask_low, cfg.seq_mask_high)
    worst = _any_by(mb.doc_ids, mask & (worst[0] | worst[1]), mask.numel())[mb.doc_ids]
    return {"seq_geometric": mask & (geo[0] | geo[1]), "seq_max": mask & worst}


def _kl_flags(logp: Tensor, logq: Tensor, mb: MicroBatch, cfg: Config, mask: Tensor) -> dict[str, Tensor]:
    """Loss tokens each --kl-mask removes (OR-ed per sequence under --seq-mask): an estimate
    of KL(q||p) at the sampled token above the threshold; log r clamped to +-20."""
    lr = (logp - logq).clamp(-METRIC_CLAMP, METRIC_CLAMP)
    l1q, l1p = ((-x.clamp(max=0).expm1()).log().clamp(min=-METRIC_CLAMP) for x in (logq, logp))  # log(1 - e^x)
    est = {"k1": lr.abs(), "k3": _k3(lr), "binary": logq.exp() * -lr + l1q.exp() * (l1q - l1p)}
    flags = {f"kl_{k}": mask & (v > cfg.kl_mask_threshold) for k, v in est.items()}
    if cfg.seq_mask == "off":
        return flags
    return {k: mask & _any_by(mb.doc_ids, v, mask.numel())[mb.doc_ids] for k, v in flags.items()}


def _keep(logp: Tensor, logq: Tensor, mb: MicroBatch, cfg: Config, mask: Tensor, metrics: Metrics) -> Tensor:
    """False on the tokens that --seq-mask and --kl-mask take out of the policy term."""
    drop = torch.zeros_like(mask)
    for kind, choice, flags in (("kl", cfg.kl_mask, _kl_flags), ("seq", cfg.seq_mask, _seq_flags)):
        if choice != "off":
            f = flags(logp, logq, mb, cfg, mask)[f"{kind}_{choice}"]
            metrics[f"{kind}_mask/masked_fraction"] = _stat(f.to(logp.dtype), mask)
            drop = drop | f
    return ~drop


def _would_mask(lp: Tensor, logq: Tensor, mb: MicroBatch, cfg: Config, mask: Tensor) -> Metrics:
    """--correction-metrics-only: the share of loss tokens each correction would mask (tis: clip)
    with the current bounds, the mean ratio, chi^2 = E[r^2] - 1 and ESS/n per sequence."""
    flags = {k: mask & torch.stack(_weight(lp, logq, name, cfg)[1:]).any(0)
             for k, name in (("icepop", "icepop"), ("ipo", "ipo"), ("tis_clip", "tis"))}
    flags |= _seq_flags(lp, logq, mb, cfg, mask) | _kl_flags(lp, logq, mb, cfg, mask)
    out = {f"correction/would_mask/{k}": _stat(v.to(lp.dtype), mask) for k, v in flags.items()}
    r = (lp - logq).clamp(-METRIC_CLAMP, METRIC_CLAMP).exp()
    x = torch.stack([torch.ones_like(r), r, r * r], 1) * mask[:, None]  # r is finite: a product is safe
    n, s1, s2 = _sum_by(mb.doc_ids, x, len(x)).unbind(1)  # per sequence
    out["correction/ratio"], out["correction/chi2"] = _stat(r, mask), _stat(r * r - 1, mask)
    out["correction/ess"] = _stat(s1 * s1 / (n * s2), n > 0)  # (sum r)^2 / (n sum r^2), per sequence
    return out


# ----------------------------------------------------------------------------- support rows

@dataclass
class _Rows:
    """The support entries of one micro-batch, each tied to its token."""

    row: Tensor  # int64 [nnz] token of each entry
    counts: Tensor  # int64 [T] entries per row
    u: Tensor  # [nnz] q_v (replayed) or 1/K (draws); 0 on rows outside the loss
    logp: Tensor  # [nnz] trainer log-prob, detached
    logq: Tensor  # [nnz] sampler log-prob; the trainer's own outside the loss

    def sum(self, x: Tensor) -> Tensor:
        """[T]: x summed over each row's entries."""
        return _sum_by(self.row, x, self.counts.numel())


def _entry_rows(offsets: Tensor, nnz: int) -> Tensor:
    """Row of each entry without a host sync; cummax keeps it defined on broken offsets."""
    mono, at = torch.cummax(offsets, 0).values, torch.arange(nnz, device=offsets.device)
    return (torch.searchsorted(mono, at, right=True) - 1).clamp(0, offsets.numel() - 2)


def _rows(sup: TokenSupport, support_logp: Tensor, mask: Tensor) -> _Rows:
    row = _entry_rows(sup.offsets, support_logp.numel())
    counts = sup.offsets[1:] - sup.offsets[:-1]
    live = mask[row]
    logp = support_logp.detach()
    logq = torch.where(live, sup.logq.to(logp.dtype), logp)
    u = torch.where(sup.replayed[row], logq.exp(), 1.0 / counts[row].clamp(min=1).to(logp.dtype))
    return _Rows(row, counts, torch.where(live, u, 0.0), logp, logq)


# ----------------------------------------------------------------------------- metrics

def _stat(values: Tensor, on: Tensor) -> tuple[Tensor, Tensor]:
    """(sum over the tokens `on`, their count); where, not a product, keeps an inf elsewhere out."""
    return torch.where(on, values.detach(), 0.0).sum(), on.sum().to(values.dtype)


def _masked_stats(name: str, low: Tensor, high: Tensor, mask: Tensor, dtype: torch.dtype) -> Metrics:
    """Fractions of loss tokens a mask removed (tis: clipped); the count is every loss token, never 1 - mean."""
    key = f"{name}/clip_fraction" if name == "tis" else f"{name}/masked_fraction"
    out = {key: _stat((low | high).to(dtype), mask)}
    if name != "ipo":
        out[f"{key}/low"], out[f"{key}/high"] = _stat(low.to(dtype), mask), _stat(high.to(dtype), mask)
    return out


def _k3(log_r: Tensor) -> Tensor:
    """r - 1 - log r, an estimate of KL(q||p) from a draw of q; expm1: no -1e-9 at r ~ 1."""
    lr = log_r.clamp(-METRIC_CLAMP, METRIC_CLAMP)
    return (torch.expm1(lr) - lr).clamp(min=0)


def _token_stats(log_r: Tensor, entropy: Tensor, age: Tensor, cfg: Config, mask: Tensor) -> Metrics:
    """Entropy and the sampler mismatch; with --async-level also the mean age and KL(q||p) on age-0 tokens
    (k3; with --kl-coeff _kl_term logs its estimator), telling engine mismatch from staleness. The
    synchronous loop leaves them out: every age is 0 there and kl/age0 would repeat mismatch/kl."""
    out = {"entropy": _stat(entropy.to(log_r.dtype), mask), "mismatch/kl": _stat(_k3(log_r), mask),
           "mismatch/abs_logratio": _stat(log_r.clamp(-METRIC_CLAMP, METRIC_CLAMP).abs(), mask)}
    if cfg.async_level > 0:
        out["staleness/mean"] = _stat(age, mask)
        if cfg.kl_coeff == 0:
            out["kl/age0"] = _stat(_k3(log_r), mask & (age == 0))
    return out


# ----------------------------------------------------------------------------- the loss terms

def _centered_term(logp: Tensor, logq: Tensor, adv: Tensor, rows: _Rows | None, support_logp: Tensor,
                   cfg: Config, keep: Tensor, mask: Tensor, metrics: Metrics) -> Tensor:
    """reinforce/icepop/ipo/tis: -A*(w(a)*log p(a) - sum_v sg[u_v*w(v)]*log p(v)), w = 0 off `keep`."""
    w, low, high = _weight(logp.detach(), logq, cfg.loss, cfg)
    if cfg.loss != "reinforce":
        metrics.update(_masked_stats(cfg.loss, low, high, mask, logp.dtype))
    score = torch.where(keep, w, 0.0) * logp
    if rows is not None:
        wv = torch.where(keep[rows.row], _weight(rows.logp, rows.logq, cfg.loss, cfg)[0], 0.0)
        score = score - rows.sum((rows.u * wv).detach() * support_logp)
        r = (rows.logp - rows.logq).clamp(-METRIC_CLAMP, METRIC_CLAMP).exp()
        centered = mask & (rows.counts > 0)
        metrics["score_centering/support_mass"] = _stat(rows.sum(rows.u * r), centered)
        metrics["score_centering/mask_tv"] = _stat(0.5 * rows.sum(rows.u * (r - wv).abs()), centered)
    return -adv * score


def _clipped_term(logp: Tensor, logq: Tensor, adv: Tensor, old: Tensor, cfg: Config, keep: Tensor,
                  mask: Tensor, metrics: Metrics) -> Tensor:
    """ppo/cispo: the clip on rho = p/pi_old, times M(k), k = pi_old/q, with --icepop; 0 off `keep`."""
    log_rho = logp.detach() - old
    lo, hi = math.log1p(-cfg.clip_low), math.log1p(cfg.clip_high)
    m = keep.to(logp.dtype)  # 0 where a sequence or KL mask removes the token
    if cfg.icepop:
        mk, low, high = _weight(old, logq, "icepop", cfg)
        m = m * mk
        metrics.update(_masked_stats("icepop", low, high, mask, logp.dtype))
    clipped_rho = log_rho.clamp(lo, hi).exp()
    if cfg.loss == "cispo":
        clipped = (log_rho < lo) | (log_rho > hi)
        term = -adv * (m * clipped_rho) * logp
    else:
        # min(rho*A, clip(rho)*A) picks the constant only on the side the update pushes out
        clipped = ((adv > 0) & (log_rho > hi)) | ((adv < 0) & (log_rho < lo))
        live = ~clipped & (m > 0)
        rho = torch.where(live, logp - old, 0.0).exp()  # no exp of a masked ratio, even in backward
        term = -m * adv * torch.where(clipped, clipped_rho, rho)
    metrics["ppo/clip_fraction"] = _stat(clipped.to(logp.dtype), mask)
    return term


def _kl_term(logp: Tensor, logq: Tensor, rows: _Rows | None, support_logp: Tensor, age: Tensor, cfg: Config,
             mask: Tensor, metrics: Metrics) -> Tensor:
    """beta_t * KL_t(q||p): exact over the support row, or k1 on the sampled token."""
    kl = logq - logp
    if cfg.kl_estimator == "exact" and rows is not None:
        kl = torch.where(rows.counts > 0, rows.sum(rows.u * (rows.logq - support_logp)), kl)
    beta = cfg.kl_coeff * ((1 + age).rsqrt() if cfg.kl_staleness == "inv_sqrt" else torch.ones_like(age))
    metrics.update({"kl": _stat(kl, mask), "kl/beta": _stat(beta, mask), "kl/age0": _stat(kl, mask & (age == 0))})
    return beta * kl


def _normalization(mb: MicroBatch, cfg: Config, denom: Denominators, dtype: torch.dtype) -> tuple[Tensor, Tensor, int]:
    """Per-token coefficient of the global loss; (coef, this micro-batch's count, global count)."""
    f = mb.loss_mask.to(dtype)
    if cfg.loss_agg == "token":
        return f / max(denom.tokens, 1), f.sum(), max(denom.tokens, 1)
    per_doc, d = _sum_by(mb.doc_ids, f, f.numel()), max(denom.seqs, 1)
    return f / (per_doc[mb.doc_ids].clamp(min=1) * d), (per_doc > 0).sum().to(dtype), d


def rl_loss(logp: Tensor, support_logp: Tensor, entropy: Tensor, mb: MicroBatch, cfg: Config,
            denom: Denominators, step: int | Tensor, old_logp: Tensor | None = None) -> tuple[Tensor, Metrics]:
    """This micro-batch's share of the global loss, and its (sum, count) metrics; no host sync.

    logp [T] and support_logp [nnz] carry grad (renormalized over the row where replayed);
    entropy [T] is a metric; old_logp [T] is pi_old for ppo/cispo (None: sg(logp))."""
    mask, lp = mb.loss_mask, logp.detach()
    adv = torch.where(mask, mb.advantages.to(lp.dtype), 0.0) * cfg.adv_tau
    logq = torch.where(mask, mb.logq.to(lp.dtype), lp)
    age = (step - mb.versions).clamp(min=0).to(lp.dtype)  # the rollouts' rule (rollout.py); step may be 0-d
    metrics = _token_stats(lp - logq, entropy, age, cfg, mask)
    if cfg.correction_metrics_only:  # plain reinforce; the corrections only say what they would mask
        metrics.update(_would_mask(lp, logq, mb, cfg, mask))
        cfg = replace(cfg, loss="reinforce", seq_mask="off", kl_mask="off", correction_metrics_only=False)
    centered = cfg.loss in CENTERED
    old = lp if centered or old_logp is None else torch.where(mask, old_logp.detach().to(lp.dtype), lp)
    keep = _keep(old, logq, mb, cfg, mask, metrics)  # judges p/q, or pi_old/q for ppo/cispo
    needs_rows = centered or (cfg.kl_coeff > 0 and cfg.kl_estimator == "exact")
    rows = _rows(mb.support, support_logp, mask) if mb.support is not None and needs_rows else None
    per_token = (_centered_term(logp, logq, adv, rows, support_logp, cfg, keep, mask, metrics) if centered
                 else _clipped_term(logp, logq, adv, old, cfg, keep, mask, metrics))
    if cfg.kl_coeff > 0:  # never masked: a regularizer, not a correction
        per_token = per_token + _kl_term(logp, logq, rows, support_logp, age, cfg, mask, metrics)
    coef, count, d = _normalization(mb, cfg, denom, lp.dtype)
    loss = (coef * torch.where(mask, per_token, 0.0)).sum()
    metrics["loss"] = (loss.detach() * d, count)
    return loss, metrics


def sft_loss(logp: Tensor, mb: MicroBatch, denom: Denominators) -> tuple[Tensor, Metrics]:
    """Supervised warm-up: mean negative log-likelihood over the global batch's loss tokens."""
    nll = torch.where(mb.loss_mask, -logp, 0.0)
    return nll.sum() / max(denom.tokens, 1), {"loss": (nll.detach().sum(), mb.loss_mask.sum().to(logp.dtype))}


def accumulate(total: Metrics, metrics: Metrics) -> None:
    """Add (sum, count) pairs into `total` on the device; no sync."""
    for k, (s, c) in metrics.items():
        s0, c0 = total.get(k, (0.0, 0.0))
        total[k] = (s0 + s.detach(), c0 + c)


def reduce_metrics(total: Metrics) -> dict[str, float]:
    """{name: sum / count}, one host sync; names with a zero count are left out."""
    if not total:
        return {}
    pairs = torch.stack([torch.stack([s.double(), c.double()]) for s, c in total.values()]).tolist()
    return {k: s / c for k, (s, c) in zip(total, pairs) if c != 0}


# ----------------------------------------------------------------------------- evidence

CHECKS = ("support offsets are not non-decreasing from 0 to nnz",  # structural: always raises
          "label not in [0, V)", "support id not in [0, V)", "logq is not finite (NaN or inf)", "logq > 0",
          "support logq is not finite (NaN or inf)", "support logq > 0", "replayed row lacks its sampled token",
          "replayed q does not sum to 1 (tolerance 1e-3)", "draws row size != --score-centering-k",
          "draws row is empty on a trained token (its score centering, and the sparse backward, need the K draws)")


def _evidence_fails(mb: MicroBatch, vocab_size: int, k: int, centered: bool) -> tuple[Tensor, Tensor | None]:
    """[len(CHECKS), T] bool, one row per check, and each support entry's row."""
    mask, labels, logq, sup, row = mb.loss_mask, mb.labels, mb.logq, mb.support, None
    T, no = mask.numel(), torch.zeros_like(mask)
    out = [no, (labels < 0) | (labels >= vocab_size), no, ~torch.isfinite(logq), logq > 0] + [no] * 6
    if sup is not None:
        if sup.offsets.numel() != T + 1:
            raise RunError(f"bad sampler evidence: support has {sup.offsets.numel() - 1} rows for {T} tokens")
        off, ids, slq = sup.offsets, sup.ids.long(), sup.logq
        counts, row = off[1:] - off[:-1], _entry_rows(off, ids.numel())
        ends = torch.zeros_like(mask)
        ends[0], ends[-1] = off[0] != 0, off[-1] != ids.numel()
        out[0] = (counts < 0) | ends
        entry = ((ids < 0) | (ids >= vocab_size), ~torch.isfinite(slq), slq > 0)  # the label and logq checks
        out[2], out[5], out[6] = (_any_by(row, f, T) for f in entry)  # each OR-ed over its row
        out[7] = sup.replayed & ~_any_by(row, ids == labels[row], T)
        out[8] = sup.replayed & (counts > 0) & ~((_sum_by(row, slq.double().exp(), T) - 1).abs() <= 1e-3)
        out[9] = ~sup.replayed & (counts > 0) & (counts != k)
        out[10] = ~sup.replayed & (counts == 0) & centered
    fails = torch.stack(out)
    fails[1:] &= mask  # only what the loss reads; offsets are checked on every row
    return fails, row


def _drop(mb: MicroBatch, bad: Tensor, row: Tensor | None, vocab_size: int) -> None:
    """Untrain every token of the bad samples; zero their out-of-range ids so the head can gather."""
    gone = (mb.sample_idx >= 0) & bad[mb.sample_idx.clamp(min=0)]
    mb.loss_mask &= ~gone
    mb.labels.masked_fill_(gone & ((mb.labels < 0) | (mb.labels >= vocab_size)), 0)
    if row is not None:
        ids = mb.support.ids
        ids.masked_fill_(gone[row] & ((ids < 0) | (ids >= vocab_size)), 0)


def validate_evidence(micro_batches: list[MicroBatch], vocab_size: int, cfg: Config) -> Metrics:
    """Check the sampler evidence of the step on the device; one host sync at the end.

    --bad-evidence error raises ValueError naming the sample, its token and the check;
    drop untrains the bad samples in place (call before denominators) and counts them."""
    if not micro_batches:
        return {}
    dev = micro_batches[0].loss_mask.device
    space = max((max(mb.samples) + 1 for mb in micro_batches if mb.samples), default=1)
    bad = torch.zeros(space, dtype=torch.int64, device=dev)  # failures per sample index
    firsts, rows = [], []
    for mb in micro_batches:
        centered = cfg.loss in CENTERED or cfg.correction_metrics_only  # these read every trained token's row
        fails, row = _evidence_fails(mb, vocab_size, cfg.score_centering_k, centered)
        T = fails.shape[1]
        t = torch.arange(T, device=dev)
        pos = torch.where(fails, t, T).amin(dim=1)  # first failure of each check; T: none
        at = pos.clamp(max=T - 1)
        start = torch.full_like(t, T).scatter_reduce(0, mb.doc_ids, torch.where(mb.loss_mask, t, T), "amin")
        token = t - start[mb.doc_ids]  # k for the k-th completion token of its sample (its document)
        firsts.append(torch.stack([pos, mb.sample_idx[at], token[at]]))
        hit = fails[1:].any(0) & (mb.sample_idx >= 0)
        bad.index_add_(0, mb.sample_idx.clamp(min=0), hit.long())
        rows.append(row)
    if cfg.bad_evidence == "drop":
        for mb, row in zip(micro_batches, rows):
            _drop(mb, bad > 0, row, vocab_size)
    counts = [mb.loss_mask.sum() for mb in micro_batches] + [(bad > 0).sum()]  # ..., samples dropped
    host = torch.cat([torch.stack(firsts).flatten(), torch.stack(counts)]).tolist()  # the one sync
    C, M = len(CHECKS), len(micro_batches)
    for i, mb in enumerate(micro_batches):
        pos, sample, token = (host[(3 * i + j) * C:(3 * i + j + 1) * C] for j in range(3))
        c = next((c for c in range(C) if pos[c] < mb.loss_mask.numel()), None)
        if c is not None and (cfg.bad_evidence == "error" or c == 0):
            raise RunError(f"bad sampler evidence: sample {sample[c]}, token {token[c]}: {CHECKS[c]} "
                           f"(micro-batch {i}, position {pos[c]})")
    for mb, n in zip(micro_batches, host[3 * C * M:-1]):
        mb.num_loss_tokens = int(n)
    dropped = torch.tensor([host[-1], sum(len(mb.samples) for mb in micro_batches)], dtype=torch.float64, device=dev)
    return {"bad_evidence/dropped": (dropped[0], dropped[1])}
