"""The dense fp64 reference loss.py is tested against (tests/test_loss.py), written from the formulas
of docs/design.md "The loss" token by token, and the batches it runs on: random documents with a
sampler q, packed into micro-batches as data.py would, each loss token's support row replayed
or drawn. Nothing here imports loss.py's internals; it reads the flags from a Config as the user
gives them."""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch

import loss as L
from layers.masks import accumulate, m2po_bound, reduce_metrics
from config import Config
from data import MicroBatch, TokenSupport

F64 = torch.float64
V = 7  # vocabulary
K = 4  # draws per row
TEMP = 0.7
STEP = 5
aten = torch.ops.aten


def cfg_for(loss: str, **kw) -> Config:
    """Bounds tight enough that every mask triggers on the random data below."""
    clip = 0.05 if loss == "gspo" else 0.1  # a sequence's mean ratio spreads less than a token's
    base = dict(loss=loss, icepop_alpha=0.5, icepop_beta=2.0, ipo_eps=0.1, max_importance_ratio=1.5,
                clip_low=clip, clip_high=1.5 * clip, adv_tau=1.3, score_centering_k=K, sapo_tau_pos=0.8, sapo_tau_neg=2.0)
    return Config(**{**base, **kw})


# ----------------------------------------------------------------------------- building batches

@dataclass
class Doc:
    """One sample as the reference sees it: n = P + C - 1 positions, the last C trained."""

    logits: torch.Tensor  # [n, V] fp64 leaf
    labels: torch.Tensor  # int64 [n]
    mask: torch.Tensor  # bool [n]
    adv: float
    logq: torch.Tensor  # float32 [n]
    versions: torch.Tensor  # int64 [n]
    rows: list  # per position: (ids, float32 logq values)
    replayed: list  # per position
    sample: int
    old_noise: torch.Tensor  # fp64 [n]: pi_old = trainer log-prob + this
    teacher: torch.Tensor | None = None  # fp64 [n, V]: a teacher's logits (--teacher), no grad


def make_doc(g: torch.Generator, sample: int, P: int, C: int, kind: str, noise: float = 1.5) -> Doc:
    n = P + C - 1
    logits = torch.randn(n, V, generator=g, dtype=F64) * 1.5
    labels = torch.randint(V, (n,), generator=g)
    mask = torch.zeros(n, dtype=torch.bool)
    mask[P - 1:] = True
    logq = torch.zeros(n, dtype=torch.float32)
    rows, replayed = [([], [])] * n, [False] * n
    for i in range(P - 1, n):
        s = torch.log_softmax(logits[i] / TEMP, -1) + noise * torch.randn(V, generator=g, dtype=F64)
        if kind == "replayed":  # top-k truncation, shuffled order
            k = int(torch.randint(2, V + 1, (1,), generator=g))
            keep = torch.topk(s, k).indices[torch.randperm(k, generator=g)]
            lq = torch.log_softmax(s[keep], -1).float()
            j = int(torch.multinomial(lq.double().exp(), 1, generator=g))
            labels[i], logq[i] = keep[j], lq[j]
            rows[i], replayed[i] = (keep.tolist(), lq.tolist()), True
        else:
            lq = torch.log_softmax(s, -1).float()
            a = int(torch.multinomial(lq.double().exp(), 1, generator=g))
            draws = torch.multinomial(lq.double().exp(), K, replacement=True, generator=g)
            labels[i], logq[i] = a, lq[a]
            rows[i] = (draws.tolist(), lq[draws].tolist())
    adv = float(torch.randn(1, generator=g))
    versions = torch.randint(STEP - 3, STEP + 2, (n,), generator=g)
    return Doc(logits.requires_grad_(), labels, mask, adv, logq, versions, rows, replayed, sample,
               0.3 * torch.randn(n, generator=g, dtype=F64))


def make_docs(kind: str, seed: int | None = None, shapes=((3, 5), (2, 4), (3, 0), (4, 3), (2, 1))) -> list[Doc]:
    g = torch.Generator().manual_seed(zlib.crc32(kind.encode()) if seed is None else seed)
    return [make_doc(g, s, P, C, kind) for s, (P, C) in enumerate(shapes)]


def assemble(docs: list[Doc], T: int, with_support: bool = True) -> tuple[MicroBatch, torch.Tensor, torch.Tensor]:
    """Pack docs into one [T] micro-batch the way data.pack lays it out; (mb, logits [T, V], old noise)."""
    ns = [d.labels.numel() for d in docs]
    pad = T - sum(ns)
    assert pad >= 0

    def cat(parts, fill, dtype):
        return torch.cat([p.to(dtype) for p in parts] + [torch.full((pad,), fill, dtype=dtype)])

    doc_ids = cat([torch.full((n,), j) for j, n in enumerate(ns)], len(docs), torch.int64)
    positions = torch.cat([torch.arange(n) for n in ns] + [torch.arange(pad)])
    mask = cat([d.mask for d in docs], False, torch.bool)
    adv = cat([torch.where(d.mask, d.adv, 0.0) for d in docs], 0, torch.float32)
    support = None
    if with_support:
        rows = [r for d in docs for r in d.rows] + [([], [])] * pad
        lengths = np.array([len(r[0]) for r in rows], dtype=np.int64)
        host = np.concatenate([[0], np.cumsum(lengths)])
        support = TokenSupport(torch.tensor([i for r in rows for i in r[0]], dtype=torch.int32),
                               torch.from_numpy(host.copy()),
                               torch.tensor([q for r in rows for q in r[1]], dtype=torch.float32),
                               torch.tensor([f for d in docs for f in d.replayed] + [False] * pad), host)
    mb = MicroBatch(tokens=torch.zeros(T, dtype=torch.int64), positions=positions, doc_ids=doc_ids,
                    labels=cat([d.labels for d in docs], 0, torch.int64), loss_mask=mask, advantages=adv,
                    logq=cat([d.logq for d in docs], 0, torch.float32),
                    versions=cat([d.versions for d in docs], 0, torch.int64),
                    sample_idx=cat([torch.full((n,), d.sample) for d, n in zip(docs, ns)], -1, torch.int64),
                    support=support, num_loss_tokens=int(mask.sum()),
                    samples=[d.sample for d in docs])
    logits = torch.cat([d.logits for d in docs] + [torch.zeros(pad, V, dtype=F64)])
    return mb, logits, torch.cat([d.old_noise for d in docs] + [torch.zeros(pad, dtype=F64)])


def head(logits: torch.Tensor, mb: MicroBatch, temperature: float = TEMP):
    """The fused head's contract by gathers: (logp [T], support_logp [nnz], entropy [T])."""
    lsm = torch.log_softmax(logits / temperature, -1)
    entropy = -(lsm.exp() * lsm).sum(-1).detach()
    logp = lsm.gather(1, mb.labels[:, None])[:, 0]
    if mb.support is None:
        return logp, lsm.new_zeros(0), entropy
    sup, T = mb.support, logits.shape[0]
    counts = sup.offsets[1:] - sup.offsets[:-1]
    row = torch.repeat_interleave(torch.arange(T), counts)
    slsm = lsm[row, sup.ids.long()]
    top = torch.full((T,), -math.inf, dtype=lsm.dtype).scatter_reduce(0, row, slsm.detach(), "amax")
    top = torch.where(counts > 0, top, 0.0)  # a stable log-sum-exp per row: log p may be -1000
    mass = torch.zeros(T, dtype=lsm.dtype).index_add(0, row, (slsm - top[row]).exp())
    lse = top + torch.where(counts > 0, mass, 1.0).log()
    logp = torch.where(sup.replayed & (counts > 0), logp - lse, logp)
    return logp, torch.where(sup.replayed[row], slsm - lse[row], slsm), entropy


def grads(loss: torch.Tensor, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    """d loss / d leaf; zeros for a leaf the loss never reads (a sample with no loss tokens)."""
    gs = torch.autograd.grad(loss, leaves, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for g, x in zip(gs, leaves)]


def run_loss(mbs, logits_list, cfg, old_list=None, denom=None, step=STEP, teachers=None):
    """Sum rl_loss over micro-batches as train.py does; (loss, reduced metrics). `teachers`: each
    micro-batch's teacher logits, through the same head."""
    denom = denom or L.denominators(mbs)
    if cfg.m2po_threshold > 0:  # its bound over the whole step before the first backward, as train.py finds it
        starts = [head(lg, mb)[0].detach() + (0.0 if old_list is None else old_list[i])
                  for i, (mb, lg) in enumerate(zip(mbs, logits_list))]
        denom = replace(denom, m2_max=m2po_bound(starts, mbs, cfg.m2po_threshold))
    total, metrics = 0.0, {}
    for i, (mb, logits) in enumerate(zip(mbs, logits_list)):
        logp, slogp, ent = head(logits, mb)
        old = None if old_list is None else logp.detach() + old_list[i]
        teacher = None if teachers is None else tuple(x.detach() for x in head(teachers[i], mb)[:2])
        loss, m = L.rl_loss(logp, slogp, ent, mb, cfg, denom, step, old_logp=old, teacher=teacher)
        total = total + loss
        accumulate(metrics, m)
    return total, reduce_metrics(metrics)


# ----------------------------------------------------------------------------- the dense reference

def ref_weight(cfg: Config, p: float, q: float) -> tuple[float, str]:
    """w and why it was masked ("" kept, "low", "high"), in plain floats."""
    r = p / q
    if cfg.loss == "icepop":
        return (r, "") if cfg.icepop_alpha <= r <= cfg.icepop_beta else (0.0, "low" if r < cfg.icepop_alpha else "high")
    if cfg.loss == "ipo":
        return (min(r, cfg.max_importance_ratio), "") if abs(p - q) <= cfg.ipo_eps else (0.0, "masked")
    if cfg.loss == "tis":
        why = "low" if r < cfg.tis_floor else "high" if r > cfg.tis_cap else ""
        return min(max(r, cfg.tis_floor), cfg.tis_cap), why
    return 1.0, ""


class Stats(dict):
    """name -> [sum, count], as plain floats."""

    def add(self, name: str, value: float, n: float = 1.0) -> None:
        s = self.setdefault(name, [0.0, 0.0])
        s[0], s[1] = s[0] + value, s[1] + n


def clamp20(x: float) -> float:
    return min(max(x, -20.0), 20.0)  # metrics only, as loss.py


@dataclass
class Tok:
    """One trained token as the reference sees it."""

    lp: object  # v -> trainer log p(v) (a 0-d tensor with grad), renormalized over a replayed row
    a: int
    A: float  # advantage times adv_tau
    lq_a: float
    ids: list
    lqs: list
    u: list
    replayed: bool = False
    lt: object = None  # v -> the teacher's log t(v) as a float, renormalized over a replayed row (--teacher)


def ref_centered(cfg: Config, t: Tok, keep: bool, st: Stats) -> torch.Tensor:
    """-A*(w(a)*log p(a) - sum_v u_v*w(v)*log p(v)), w from plain floats so it carries no grad;
    a sequence or KL mask (keep False) sets every w of the token to 0."""
    wa, why = ref_weight(cfg, math.exp(t.lp(t.a).item()), math.exp(t.lq_a))
    term = wa * keep * t.lp(t.a)
    name = "tis/clip_fraction" if cfg.loss == "tis" else f"{cfg.loss}/masked_fraction"
    if cfg.loss != "reinforce":
        st.add(name, float(why != ""))
    if cfg.loss in ("icepop", "tis"):
        st.add(f"{name}/low", float(why == "low"))
        st.add(f"{name}/high", float(why == "high"))
    if t.ids:
        mass = tv = 0.0
        for v, lq, uv in zip(t.ids, t.lqs, t.u):
            pv = math.exp(t.lp(v).item())
            wv = ref_weight(cfg, pv, math.exp(lq))[0] * keep
            term = term - uv * wv * t.lp(v)
            rv = math.exp(clamp20(math.log(pv) - lq))
            mass, tv = mass + uv * rv, tv + 0.5 * uv * abs(rv - wv)
        st.add("score_centering/support_mass", mass)
        st.add("score_centering/mask_tv", tv)
    return -t.A * term


def ref_icepop_m(cfg: Config, t: Tok, old_a: float, keep: bool, st: Stats) -> tuple[float, bool]:
    """(M, whether M keeps the token): M(k) = k inside [alpha, beta], else 0 (with --icepop; 1 without),
    times the sequence/KL masks; kept is the interval test, not M > 0 (a kept k may underflow)."""
    m, kept = 1.0, keep
    if cfg.icepop_mask:
        k = math.exp(old_a - t.lq_a)
        inside = cfg.icepop_alpha <= k <= cfg.icepop_beta
        m, kept = (k if inside else 0.0), kept and inside
        st.add("icepop/masked_fraction", float(not inside))
        st.add("icepop/masked_fraction/low", float(k < cfg.icepop_alpha))
        st.add("icepop/masked_fraction/high", float(k > cfg.icepop_beta))
    return m * keep, kept


def ref_clipped(cfg: Config, t: Tok, old_a: float, keep: bool, st: Stats) -> torch.Tensor:
    """ppo: -M*min(rho*A, clip(rho)*A); cispo: -A*M*sg(clip(rho))*log p(a)."""
    logp_a = t.lp(t.a)
    rho = torch.exp(logp_a - old_a)
    m, _ = ref_icepop_m(cfg, t, old_a, keep, st)
    lo, hi, A = 1 - cfg.clip_low, 1 + cfg.clip_high, t.A
    if cfg.loss == "ppo":
        st.add("ppo/clip_fraction", float((A > 0 and rho.item() > hi) or (A < 0 and rho.item() < lo)))
        return -m * torch.minimum(rho * A, rho.clamp(lo, hi) * A)
    st.add("ppo/clip_fraction", float(not lo <= rho.item() <= hi))
    return -A * m * min(max(rho.item(), lo), hi) * logp_a


def ref_gspo(cfg: Config, toks: list, keep: list[bool], st: Stats) -> list[torch.Tensor]:
    """gspo, one sequence: s = exp(mean of log p(a)/pi_old(a) over the tokens M keeps), a tensor
    with grad; each token's term -M*min(s*A, clip(s)*A), the sequence's A being every token's."""
    ms, kept = zip(*(ref_icepop_m(cfg, t, old_a, k, st) for (t, old_a, _), k in zip(toks, keep)))
    on = [(t, old_a) for (t, old_a, _), on in zip(toks, kept) if on]
    log_s = sum((t.lp(t.a) - old_a for t, old_a in on), torch.zeros((), dtype=F64)) / max(len(on), 1)
    s, A = torch.exp(log_s), toks[0][0].A
    lo, hi = 1 - cfg.clip_low, 1 + cfg.clip_high
    clipped = (A > 0 and s.item() > hi) or (A < 0 and s.item() < lo)
    for _ in toks:
        st.add("ppo/clip_fraction", float(clipped))
    return [-m * torch.minimum(s * A, s.clamp(lo, hi) * A) for m in ms]


def ref_sapo(cfg: Config, t: Tok, old_a: float, keep: bool, st: Stats) -> torch.Tensor:
    """SAPO: -M*A*f(rho), f(x) = (4/tau)*sigmoid(tau*(x - 1)), tau_pos where A > 0, tau_neg otherwise; rho with grad."""
    rho = torch.exp(t.lp(t.a) - old_a)
    m, _ = ref_icepop_m(cfg, t, old_a, keep, st)
    tau = cfg.sapo_tau_pos if t.A > 0 else cfg.sapo_tau_neg
    x = tau * (rho - 1)
    st.add("sapo/gate_weight", 4 / ((1 + math.exp(-x.item())) * (1 + math.exp(x.item()))))  # 4*s*(1 - s)
    return -m * t.A * (4 / tau) * torch.exp(-torch.nn.functional.softplus(-x))  # sigmoid, its gradient exact near 1


def ref_topr_weight(A: float, lps: list[float], lqs: list[float]) -> tuple[float, bool]:
    """TOPR's weight of one sequence: 1 where A >= 0; the trajectory ratio prod p/q truncated to [0, 1] where A < 0."""
    ratio = math.prod(math.exp(lp - lq) for lp, lq in zip(lps, lqs))
    return (1.0, False) if A >= 0 else (min(ratio, 1.0), ratio > 1)


def ref_topr(toks: list, keep: list[bool], st: Stats) -> list[torch.Tensor]:
    """TOPR, one sequence: -A*w*log p(a) on each token, w detached (a plain float), no centering."""
    A = toks[0][0].A
    w, clipped = ref_topr_weight(A, [t.lp(t.a).item() for t, _, _ in toks], [t.lq_a for t, _, _ in toks])
    for _ in toks:
        st.add("topr/clip_fraction", float(clipped))
    return [-A * w * k * t.lp(t.a) for (t, _, _), k in zip(toks, keep)]


def ref_kl(cfg: Config, t: Tok, age: int, st: Stats) -> torch.Tensor:
    if cfg.kl_estimator == "exact" and t.ids:
        kl = sum(uv * (lq - t.lp(v)) for v, lq, uv in zip(t.ids, t.lqs, t.u))
    else:
        kl = t.lq_a - t.lp(t.a)
    beta = cfg.kl_coeff * (1 / math.sqrt(1 + age) if cfg.kl_staleness == "inv_sqrt" else 1.0)
    st.add("kl", kl.item())
    st.add("kl/beta", beta)
    if age == 0:
        st.add("kl/age0", kl.item())
    return beta * kl


def ref_distill(cfg: Config, t: Tok, st: Stats) -> torch.Tensor:
    """lambda * sum_v sg[omega_v*(log p(v) - log t(v))] * log p(v) of docs/design.md "On-policy distillation":
    k1 the sampled token alone with omega = 1; exact every entry of the row, omega_v = p(v) on a replayed
    row, p(v)/(K*q(v)) on K draws; exact with no row is k1. distill/kl is the sum of the sg[...] factors."""
    if cfg.distill_estimator == "exact" and t.ids:
        p = [math.exp(t.lp(v).item()) for v in t.ids]
        omega = p if t.replayed else [pv / (len(t.ids) * math.exp(lq)) for pv, lq in zip(p, t.lqs)]
        coefs = [w * (t.lp(v).item() - t.lt(v)) for w, v in zip(omega, t.ids)]
        value, term = sum(coefs), sum(c * t.lp(v) for c, v in zip(coefs, t.ids))
    else:
        value = t.lp(t.a).item() - t.lt(t.a)
        term = value * t.lp(t.a)
    st.add("distill/kl", value)
    st.add("distill/share", cfg.distill_coeff * abs(value), abs(t.A) + cfg.distill_coeff * abs(value))
    return cfg.distill_coeff * term


def ref_seq_masked(cfg: Config, mode: str, lks: list[float]) -> bool:
    """--seq-mask in plain floats: the geometric mean as a root of the product (short sequences)."""
    rs = [math.exp(x) for x in lks]
    inside = (lambda r: cfg.seq_mask_low <= r <= cfg.seq_mask_high)
    return not inside(math.prod(rs) ** (1 / len(rs))) if mode == "geometric" else not all(map(inside, rs))


def ref_kl_estimate(kind: str, lp: float, lq: float) -> float:
    p, q = math.exp(lp), math.exp(lq)
    if kind == "k1":
        return abs(lq - lp)
    if kind == "k3":
        return p / q - 1 - math.log(p / q)
    if kind == "binary_tv":
        return abs(p - q)  # TV(Bern(q), Bern(p)) = (|p - q| + |(1 - p) - (1 - q)|) / 2
    return q * math.log(q / p) + (1 - q) * math.log((1 - q) / (1 - p))  # binary


def ref_kl_flags(cfg: Config, kind: str, lps: list[float], lqs: list[float], A: float) -> list[bool]:
    """Directional (DPPO): flagged only when A > 0 and p > q, or A < 0 and p < q."""
    further = [not cfg.kl_mask_directional or (A > 0 and lp > lq) or (A < 0 and lp < lq) for lp, lq in zip(lps, lqs)]
    flags = [f and ref_kl_estimate(kind, lp, lq) > cfg.kl_mask_threshold for lp, lq, f in zip(lps, lqs, further)]
    return [any(flags)] * len(flags) if cfg.seq_mask != "off" else flags


def ref_keep(cfg: Config, lps: list[float], lqs: list[float], A: float, st: Stats) -> list[bool]:
    """Which tokens of one sequence --seq-mask and --kl-mask leave in the policy term."""
    drop = [False] * len(lps)
    if cfg.kl_mask != "off":
        drop = ref_kl_flags(cfg, cfg.kl_mask, lps, lqs, A)
        for f in drop:
            st.add("kl_mask/masked_fraction", float(f))
    if cfg.seq_mask != "off":
        seq = ref_seq_masked(cfg, cfg.seq_mask, [lp - lq for lp, lq in zip(lps, lqs)])
        drop = [f or seq for f in drop]
        st.add("seq_mask/masked_fraction", float(seq) * len(lps), len(lps))
    return [not f for f in drop]


def ref_would_mask(cfg: Config, lps: list[float], lqs: list[float], A: float, st: Stats) -> None:
    """--correction-metrics-only's metrics for one sequence, from their definitions."""
    n = len(lps)
    rs = [math.exp(lp - lq) for lp, lq in zip(lps, lqs)]
    for loss_type, key in (("icepop", "icepop"), ("ipo", "ipo"), ("tis", "tis_clip")):
        c = replace(cfg, loss=loss_type)
        for lp, lq in zip(lps, lqs):
            st.add(f"correction/would_mask/{key}", float(ref_weight(c, math.exp(lp), math.exp(lq))[1] != ""))
    for mode in ("geometric", "max"):
        st.add(f"correction/would_mask/seq_{mode}", n * float(ref_seq_masked(cfg, mode, [math.log(r) for r in rs])), n)
    for kind in ("k1", "k3", "binary", "binary_tv"):
        for f in ref_kl_flags(cfg, kind, lps, lqs, A):
            st.add(f"correction/would_mask/kl_{kind}", float(f))
    st.add("correction/would_mask/topr_clip", n * float(ref_topr_weight(A, lps, lqs)[1]), n)
    for r in rs:
        st.add("correction/ratio", r)
        st.add("correction/chi2", r * r - 1)
    st.add("correction/ess", sum(rs) ** 2 / (n * sum(r * r for r in rs)))


def ref_m2po_dropped(cfg: Config, docs: list[Doc], old: bool) -> set:
    """M2PO from its definition: the step's loss tokens by (log r)^2, r = pi_old/q (pi_old = p + the noise with
    `old`), the largest dropped one at a time until the mean over the rest is <= tau; (doc, position) of each dropped."""
    values = {}
    for j, d in enumerate(docs):
        for i in torch.nonzero(d.mask).flatten().tolist():
            z = torch.log_softmax(d.logits[i].detach() / TEMP, -1)
            lp = z[int(d.labels[i])] - (torch.logsumexp(z[d.rows[i][0]], 0) if d.replayed[i] else 0.0)
            values[j, i] = (float(lp) + (float(d.old_noise[i]) if old else 0.0) - float(d.logq[i])) ** 2
    kept = sorted(values, key=values.get)
    while kept and sum(values[k] for k in kept) / len(kept) > cfg.m2po_threshold:
        kept.pop()
    return set(values) - set(kept)


def reference(docs: list[Doc], cfg: Config, step: int, old: bool):
    """The loss of docs/design.md "The loss", token by token over full-vocabulary logits; (loss, metrics)."""
    st = Stats()
    n_tok = sum(int(d.mask.sum()) for d in docs)
    n_seq = sum(int(d.mask.any()) for d in docs)
    total = torch.zeros((), dtype=F64)
    train = cfg
    if cfg.correction_metrics_only:
        train = replace(cfg, loss="reinforce", seq_mask="off", kl_mask="off", kl_mask_directional=False,
                        correction_metrics_only=False)
    centered = train.loss in ("reinforce", "icepop", "ipo", "tis")
    clipped = train.loss in ("ppo", "cispo", "gspo", "sapo")
    dropped = ref_m2po_dropped(cfg, docs, old) if cfg.m2po_threshold > 0 else set()
    for j, d in enumerate(docs):
        n_doc, doc_sum, toks = int(d.mask.sum()), torch.zeros((), dtype=F64), []
        positions = torch.nonzero(d.mask).flatten().tolist()
        for i in positions:
            z = torch.log_softmax(d.logits[i] / TEMP, -1)
            ids, lqs = d.rows[i]
            norm = torch.logsumexp(z[ids], 0) if d.replayed[i] else 0.0
            u = [math.exp(x) if d.replayed[i] else 1 / len(ids) for x in lqs]
            t = Tok(lambda v, z=z, norm=norm: z[v] - norm, int(d.labels[i]), cfg.adv_tau * d.adv,
                    float(d.logq[i]), ids, lqs, u, d.replayed[i])
            st.add("entropy", -(z.exp() * z).sum().item())
            lr = clamp20(t.lp(t.a).item() - t.lq_a)
            st.add("mismatch/kl", math.exp(lr) - 1 - lr)
            st.add("mismatch/abs_logratio", abs(lr))
            old_a = t.lp(t.a).item() + (float(d.old_noise[i]) if old and clipped else 0.0)
            if d.teacher is not None:
                zt = torch.log_softmax(d.teacher[i] / TEMP, -1)
                t.lt = lambda v, zt=zt, tn=(torch.logsumexp(zt[ids], 0) if d.replayed[i] else 0.0): float(zt[v] - tn)
            toks.append((t, old_a, max(step - int(d.versions[i]), 0)))
        lqs = [t.lq_a for t, _, _ in toks]
        if cfg.correction_metrics_only and toks:
            ref_would_mask(cfg, [t.lp(t.a).item() for t, _, _ in toks], lqs, cfg.adv_tau * d.adv, st)
        keep = ref_keep(train, [o for _, o, _ in toks], lqs, cfg.adv_tau * d.adv, st) if toks else []
        if cfg.m2po_threshold > 0:  # reported under --correction-metrics-only, applied otherwise
            gone = [(j, i) in dropped for i in positions]
            for g in gone:
                st.add("correction/would_mask/m2po" if cfg.correction_metrics_only else "m2po/masked_fraction", float(g))
            keep = keep if cfg.correction_metrics_only else [k and not g for k, g in zip(keep, gone)]
        if train.loss == "gspo" and toks:  # one ratio for the whole sequence
            terms = ref_gspo(train, toks, keep, st)
        elif train.loss == "topr" and toks:
            terms = ref_topr(toks, keep, st)
        else:
            terms = [ref_centered(train, t, k, st) if centered else ref_sapo(train, t, old_a, k, st)
                     if train.loss == "sapo" else ref_clipped(train, t, old_a, k, st) for (t, old_a, _), k in zip(toks, keep)]
        for (t, old_a, age), term in zip(toks, terms):
            if cfg.kl_coeff > 0:
                term = term + ref_kl(cfg, t, age, st)
            if cfg.log_ratio_coeff > 0:  # Kimi K2.5: tau*(log p(a) - log ref)^2, ref = pi_old (clipped) or q
                sq = (t.lp(t.a) - (old_a if clipped else t.lq_a)) ** 2
                st.add("log_ratio_sq", sq.item())
                term = term + cfg.log_ratio_coeff * sq
            if cfg.distill_coeff > 0:
                term = term + ref_distill(cfg, t, st)
            doc_sum = doc_sum + term
        if n_doc:
            total = total + (doc_sum / n_tok if cfg.loss_agg == "token" else doc_sum / (n_doc * n_seq))
    n = n_tok if cfg.loss_agg == "token" else n_seq
    st["loss"] = [total.item() * n, n]
    return total, {k: s / c for k, (s, c) in st.items() if c}


# ----------------------------------------------------------------------------- 1. against the reference

VARIANTS = {  # name: (loss, --icepop, pi_old differs from p)
    "reinforce": ("reinforce", False, False), "icepop": ("icepop", False, False), "ipo": ("ipo", False, False),
    "tis": ("tis", False, False),
    "ppo": ("ppo", False, True), "ppo+icepop": ("ppo", True, True), "ppo+icepop+sg": ("ppo", True, False),
    "cispo": ("cispo", False, True), "cispo+icepop": ("cispo", True, True), "cispo+icepop+sg": ("cispo", True, False),
    "gspo": ("gspo", False, True), "gspo+icepop": ("gspo", True, True), "gspo+icepop+sg": ("gspo", True, False),
    "sapo": ("sapo", False, True), "sapo+icepop": ("sapo", True, True), "sapo+icepop+sg": ("sapo", True, False),
    "topr": ("topr", False, False)}
KLS = {"no-kl": {}, "exact": dict(kl_coeff=0.3, kl_estimator="exact", kl_staleness="inv_sqrt"),
       "k1": dict(kl_coeff=0.3, kl_estimator="k1", kl_staleness="none")}


def assert_metrics_close(got: dict, want: dict, tol: float = 1e-9):
    assert set(got) == set(want)
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=tol, abs=tol), k


def compare_with_reference(cfg, kind, old, seed=None):
    """loss.py against the dense reference on one micro-batch: loss, metrics, logit gradients."""
    docs = make_docs(kind, seed)
    mb, logits, noise = assemble(docs, T=24)
    leaves = [d.logits for d in docs]
    got, got_m = run_loss([mb], [logits], cfg, old_list=[noise] if old else None)
    want, want_m = reference(docs, cfg, STEP, old)
    assert torch.allclose(got, want, rtol=1e-9, atol=1e-12)
    assert_metrics_close(got_m, want_m)
    for g1, g2 in zip(grads(got, leaves), grads(want, leaves)):
        assert torch.allclose(g1, g2, rtol=1e-9, atol=1e-12)
    return want_m
