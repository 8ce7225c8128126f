"""loss.py against a dense fp64 reference written from the formulas of docs/design.md "The loss"
(tests/loss_reference.py holds it and the batches it runs on), plus properties (Monte Carlo
centering, micro-batch invariance, overflow, peer-bug regressions) and the sampler-evidence
checks. CPU, tiny shapes, fixed seeds."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from run import evidence as E
import loss as L
from layers.masks import accumulate, m2po_bound, reduce_metrics
from config import Config, ConfigError
from data import MicroBatch, TokenSupport
from loss_reference import (F64, KLS, STEP, TEMP, VARIANTS, Doc, K, V, assemble, assert_metrics_close, aten, cfg_for,
                            compare_with_reference, grads, head, make_docs, run_loss)


@pytest.mark.parametrize("agg", ["token", "sequence"])
@pytest.mark.parametrize("kl", list(KLS))
@pytest.mark.parametrize("kind", ["replayed", "draws"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_dense_reference(variant, kind, kl, agg):
    loss_type, icepop, old = VARIANTS[variant]
    # gspo clips whole sequences: seed 1's clip on both kinds, on the side each advantage pushes
    seed = 1 if loss_type == "gspo" else None
    want_m = compare_with_reference(cfg_for(loss_type, icepop_mask=icepop, loss_agg=agg, **KLS[kl]), kind, old, seed)
    # the masks must actually act, or this test could not catch a wrong one
    for name in ("icepop/masked_fraction", "ipo/masked_fraction", "topr/clip_fraction"):
        if name in want_m:
            assert 0 < want_m[name] < 1, name
    if loss_type == "sapo":  # no clip: its gate weights the gradient by 1 at rho = 1, less off it
        assert want_m["sapo/gate_weight"] < 1 if old else want_m["sapo/gate_weight"] == pytest.approx(1, abs=1e-15)
    elif old:
        assert want_m["ppo/clip_fraction"] > 0


CORRECTIONS = {  # name: (variant, extra flags); bounds chosen so every mask acts on the data, not on all of it
    "tis": ("tis", {}),
    "tis+floor": ("tis", dict(tis_floor=0.6, tis_cap=1.2)),
    "reinforce+seq-geometric": ("reinforce", dict(seq_mask="geometric", seq_mask_low=0.6, seq_mask_high=1.5)),
    "icepop+seq-max": ("icepop", dict(seq_mask="max", seq_mask_low=0.2, seq_mask_high=4.0)),
    "tis+kl-k1": ("tis", dict(kl_mask="k1", kl_mask_threshold=1.0)),
    "ipo+kl-k3": ("ipo", dict(kl_mask="k3", kl_mask_threshold=0.5)),
    "reinforce+kl-binary": ("reinforce", dict(kl_mask="binary", kl_mask_threshold=0.1)),
    "tis+kl-k3+seq-geometric": ("tis", dict(kl_mask="k3", kl_mask_threshold=1.0, seq_mask="geometric",
                                            seq_mask_low=0.6, seq_mask_high=1.5)),
    "reinforce+kl-binary+seq-max": ("reinforce", dict(kl_mask="binary", kl_mask_threshold=0.5, seq_mask="max",
                                                      seq_mask_low=0.2, seq_mask_high=4.0)),
    "ppo+icepop+kl-k1": ("ppo+icepop", dict(kl_mask="k1", kl_mask_threshold=1.0)),
    "cispo+kl-binary+seq-geometric": ("cispo", dict(kl_mask="binary", kl_mask_threshold=0.5, seq_mask="geometric",
                                                    seq_mask_low=0.6, seq_mask_high=1.5)),
    # DPPO's directional masks (arXiv 2602.04879): the one-update form and beside the clipped losses (pi_old/q)
    "tis+tv-directional": ("tis", dict(kl_mask="binary_tv", kl_mask_threshold=0.1, kl_mask_directional=True)),
    "reinforce+tv": ("reinforce", dict(kl_mask="binary_tv", kl_mask_threshold=0.1)),
    "icepop+kl-binary-directional": ("icepop", dict(kl_mask="binary", kl_mask_threshold=0.05, kl_mask_directional=True)),
    "ppo+tv-directional": ("ppo", dict(kl_mask="binary_tv", kl_mask_threshold=0.1, kl_mask_directional=True)),
    "cispo+kl-binary-directional": ("cispo", dict(kl_mask="binary", kl_mask_threshold=0.05, kl_mask_directional=True)),
    "sapo+icepop+tv-directional+seq-geometric": ("sapo+icepop", dict(kl_mask="binary_tv", kl_mask_threshold=0.1,
                                                                     kl_mask_directional=True, seq_mask="geometric",
                                                                     seq_mask_low=0.6, seq_mask_high=1.5)),
    "topr+kl-binary-directional": ("topr", dict(kl_mask="binary", kl_mask_threshold=0.05, kl_mask_directional=True)),
    # Kimi K2.5's tau*(log r)^2 (arXiv 2602.02276): r = p/q on the one-update form, p/pi_old on the clipped ones
    "tis+log-ratio": ("tis", dict(log_ratio_coeff=0.3)),
    "reinforce+log-ratio+seq-geometric": ("reinforce", dict(log_ratio_coeff=0.3, seq_mask="geometric",
                                                            seq_mask_low=0.6, seq_mask_high=1.5)),
    "ppo+icepop+log-ratio": ("ppo+icepop", dict(log_ratio_coeff=0.3)),
    "sapo+log-ratio": ("sapo", dict(log_ratio_coeff=0.3)),
    "topr+log-ratio": ("topr", dict(log_ratio_coeff=0.3)),
    # M2PO (arXiv 2510.01161): the step's largest (log r)^2 dropped until the mean is <= tau; r = pi_old/q
    "icepop+m2po": ("icepop", dict(m2po_threshold=0.5)),
    "ppo+icepop+m2po": ("ppo+icepop", dict(m2po_threshold=0.5)),
    "topr+m2po+tv-directional": ("topr", dict(m2po_threshold=0.5, kl_mask="binary_tv", kl_mask_threshold=0.1,
                                              kl_mask_directional=True)),
    "metrics-only+m2po": ("ppo+icepop", dict(correction_metrics_only=True, m2po_threshold=0.5)),
    "metrics-only": ("icepop", dict(correction_metrics_only=True, kl_mask_threshold=0.3)),
    "metrics-only+directional": ("icepop", dict(correction_metrics_only=True, kl_mask_threshold=0.1,
                                                kl_mask_directional=True)),
    "metrics-only+ppo+masks": ("ppo+icepop", dict(correction_metrics_only=True, seq_mask="max", kl_mask="k3",
                                                  seq_mask_low=0.2, seq_mask_high=4.0)),
}


@pytest.mark.parametrize("agg", ["token", "sequence"])
@pytest.mark.parametrize("kl", ["no-kl", "exact"])
@pytest.mark.parametrize("kind", ["replayed", "draws"])
@pytest.mark.parametrize("name", list(CORRECTIONS))
def test_corrections_match_dense_reference(name, kind, kl, agg):
    """TIS, sequence masks, KL masks and the metrics-only mode: loss, gradient and metrics."""
    variant, extra = CORRECTIONS[name]
    loss_type, icepop, old = VARIANTS[variant]
    want_m = compare_with_reference(cfg_for(loss_type, icepop_mask=icepop, loss_agg=agg, **KLS[kl], **extra), kind, old)
    for k in ("tis/clip_fraction", "kl_mask/masked_fraction", "seq_mask/masked_fraction", "m2po/masked_fraction",
              "correction/would_mask/m2po"):
        if k in want_m:  # the masks must act, and not on everything
            assert 0 < want_m[k] < 1, k


def test_denominators_count_loss_tokens_and_sequences():
    docs = make_docs("draws")
    mb, _, _ = assemble(docs, T=24)
    d = L.denominators([mb])
    assert (d.tokens, d.seqs) == (13, 4)  # C = 5 + 4 + 0 + 3 + 1; the C = 0 sample is no sequence


# ----------------------------------------------------------------------------- 2. properties

@pytest.mark.parametrize("kind", ["replayed", "draws"])
def test_p_equals_q(kind):
    docs = make_docs(kind)
    mb, logits, _ = assemble(docs, T=24)
    logp, slogp, ent = head(logits, mb)
    mb.logq, mb.support.logq = logp.detach().clone(), slogp.detach().clone()  # the sampler is the trainer
    out = {}
    masks = dict(seq_mask="geometric", kl_mask="binary", kl_mask_threshold=1e-6)
    for name, cfg in (("reinforce", cfg_for("reinforce")), ("icepop", cfg_for("icepop")),
                      ("tis+masks", cfg_for("tis", tis_floor=0.5, **masks))):
        loss, m = L.rl_loss(logp, slogp, ent, mb, cfg, L.denominators([mb]), STEP)
        out[name] = (loss, torch.autograd.grad(loss, logits, retain_graph=True)[0], reduce_metrics(m))
    (l0, g0, _), (l1, g1, m1), (l2, g2, m2) = out["reinforce"], out["icepop"], out["tis+masks"]
    assert torch.allclose(l0, l1, atol=1e-14) and torch.allclose(g0, g1, atol=1e-14)
    assert torch.allclose(l0, l2, atol=1e-14) and torch.allclose(g0, g2, atol=1e-14)
    assert m1["score_centering/support_mass"] == pytest.approx(1.0, abs=1e-12)
    assert m1["mismatch/kl"] == 0.0 and m1["icepop/masked_fraction"] == 0.0
    assert m2["tis/clip_fraction"] == m2["seq_mask/masked_fraction"] == m2["kl_mask/masked_fraction"] == 0.0


def mc_batch(N: int, p_logits: torch.Tensor, q_logits: torch.Tensor, kind: str, k: int, seed: int):
    """N tokens at one context: trainer logits p_logits, sampler q; label ~ q; A = 1."""
    g = torch.Generator().manual_seed(seed)
    n_v = p_logits.numel()
    logq_v = torch.log_softmax(q_logits, -1)
    labels = torch.multinomial(logq_v.exp(), N, replacement=True, generator=g)
    if kind == "replayed":  # the whole vocabulary is the kept set: u = q exactly
        ids, k = torch.arange(n_v).repeat(N), n_v
    else:
        ids = torch.multinomial(logq_v.exp(), N * k, replacement=True, generator=g)
    host = np.arange(N + 1, dtype=np.int64) * k
    sup = TokenSupport(ids.int(), torch.from_numpy(host.copy()), logq_v[ids].float(),
                       torch.full((N,), kind == "replayed"), host)
    ar = torch.arange(N)
    mb = MicroBatch(ar * 0, ar * 0, ar, labels, torch.ones(N, dtype=torch.bool), torch.ones(N),
                    logq_v[labels].float(), torch.full((N,), STEP), ar, sup, N, list(range(N)))
    return mb, p_logits.repeat(N, 1).requires_grad_()


def per_token_ascent(mb: MicroBatch, logits: torch.Tensor, cfg: Config) -> torch.Tensor:
    """-d loss_t / d logits_t for every token (token agg divides by N; undo it)."""
    logp, slogp, ent = head(logits, mb, temperature=1.0)
    loss, _ = L.rl_loss(logp, slogp, ent, mb, cfg, L.denominators([mb]), STEP)
    return -torch.autograd.grad(loss, logits)[0] * mb.loss_mask.numel()


def within(x: torch.Tensor, mean, n_se: float = 5.0) -> bool:
    """Sample mean of x (rows) equals `mean` within n_se standard errors, per component."""
    se = x.std(0) / math.sqrt(x.shape[0])
    return bool(((x.mean(0) - mean).abs() <= n_se * se + 1e-12).all())


P_LOGITS = torch.tensor([1.0, 0.5, 0.0, -0.5, -1.0], dtype=F64)
Q_LOGITS = P_LOGITS + torch.tensor([-0.9, 0.7, 0.4, 0.0, 0.6], dtype=F64)


@pytest.mark.parametrize("kind", ["replayed", "draws"])
def test_monte_carlo_reinforce_centering(kind):
    p, q = P_LOGITS.softmax(-1), Q_LOGITS.softmax(-1)
    mb, logits = mc_batch(20000, P_LOGITS, Q_LOGITS, kind, k=8, seed=1)
    cfg = cfg_for("reinforce", adv_tau=1.0)
    g_c = per_token_ascent(mb, logits, cfg)
    g_u = per_token_ascent(replace(mb, support=None), logits, cfg)
    assert within(g_u, q - p) and not within(g_u, torch.zeros(5))  # the drift toward the sampler
    assert within(g_c, torch.zeros(5))  # removed by centering
    # second moments: replayed E|e_a - q|^2 vs E|e_a - p|^2 differ by |q - p|^2; K draws add (1 - |q|^2)/K
    diff = (g_u ** 2).sum(1) - (g_c ** 2).sum(1)
    expected = ((q - p) ** 2).sum() - (0.0 if kind == "replayed" else (1 - (q ** 2).sum()) / 8)
    assert within(diff[:, None], expected)
    if kind == "replayed":
        assert diff.mean() > 0


@pytest.mark.parametrize("kind", ["replayed", "draws"])
def test_monte_carlo_pure_importance_weights(kind):
    cfg = cfg_for("icepop", icepop_alpha=0.0, icepop_beta=1e6)  # nothing masked: w = p/q
    mb, logits = mc_batch(20000, P_LOGITS, Q_LOGITS, kind, k=8, seed=2)
    g_c = per_token_ascent(mb, logits, cfg)
    g_u = per_token_ascent(replace(mb, support=None), logits, cfg)
    assert within(g_u, torch.zeros(5)) and within(g_c, torch.zeros(5))
    if kind == "replayed":  # sum_v q_v * (p_v/q_v) * (e_v - p) = 0 exactly
        assert torch.allclose(g_c, g_u, atol=1e-12)
    else:
        assert within(g_c - g_u, torch.zeros(5))


# ----------------------------------------------------------------------------- 3. micro-batch invariance

SPLITS = {"icepop": ("icepop", {}), "ipo": ("ipo", {}), "cispo+icepop": ("cispo+icepop", {}), "gspo+icepop": ("gspo+icepop", {}),
          "sapo+icepop+log-ratio": ("sapo+icepop", dict(log_ratio_coeff=0.3)),
          "topr+tv-directional": ("topr", dict(kl_mask="binary_tv", kl_mask_threshold=0.1, kl_mask_directional=True)),
          "tis+masks": ("tis", dict(seq_mask="geometric", seq_mask_low=0.6, seq_mask_high=1.5, kl_mask="binary")),
          "metrics-only": ("ppo+icepop", dict(correction_metrics_only=True, seq_mask="max", kl_mask="k3"))}


@pytest.mark.parametrize("agg", ["token", "sequence"])
@pytest.mark.parametrize("name", list(SPLITS))
def test_one_vs_four_micro_batches(name, agg):
    variant, extra = SPLITS[name]
    loss_type, icepop, old = VARIANTS[variant]
    cfg = cfg_for(loss_type, icepop_mask=icepop, loss_agg=agg, **KLS["exact"], **extra)
    docs = make_docs("replayed", seed=7, shapes=[(2, 4), (3, 3), (2, 0), (3, 5), (2, 2), (4, 3), (2, 6), (3, 1)])
    leaves = [d.logits for d in docs]
    one = [assemble(docs, T=64)]
    four = [assemble(docs[i:i + 2], T=16) for i in range(0, 8, 2)]
    results = []
    for parts in (one, four):
        mbs, logits, noise = zip(*parts)
        loss, metrics = run_loss(list(mbs), list(logits), cfg, old_list=list(noise) if old else None)
        results.append((loss, grads(loss, leaves), metrics))
    (l1, g1, m1), (l4, g4, m4) = results
    assert torch.allclose(l1, l4, rtol=1e-12)
    assert all(torch.allclose(a, b, rtol=1e-12, atol=1e-15) for a, b in zip(g1, g4))
    assert_metrics_close(m1, m4, tol=1e-12)


def test_m2po_bound_is_the_steps_on_one_rank_or_two():
    """--m2po-threshold's bound covers the optimizer step: 1 rank x 4 micro-batches and 2 ranks x 2 (the
    same batch dealt as my_share deals it, each rank's values gathered) give one bound, one mask and one
    gradient; a bound found per micro-batch would not."""
    cfg = cfg_for("tis", m2po_threshold=0.5, **KLS["exact"])
    docs = make_docs("replayed", seed=7, shapes=[(2, 4), (3, 3), (2, 0), (3, 5), (2, 2), (4, 3), (2, 6), (3, 1)])
    leaves = [d.logits for d in docs]
    mbs, logits, _ = map(list, zip(*[assemble(docs[i:i + 2], T=16) for i in range(0, 8, 2)]))
    starts = [head(lg, mb)[0].detach() for mb, lg in zip(mbs, logits)]
    one = m2po_bound(starts, mbs, cfg.m2po_threshold)
    ranks = [[0, 2], [1, 3]]
    seen = []  # each rank's own values, as the gather receives them
    for r in ranks:
        m2po_bound([starts[i] for i in r], [mbs[i] for i in r], cfg.m2po_threshold, lambda x: seen.append(x) or x)
    two = [m2po_bound([starts[i] for i in r], [mbs[i] for i in r], cfg.m2po_threshold, lambda x: torch.cat(seen))
           for r in ranks]
    assert two == [one, one] and 0 <= one < math.inf
    assert any(m2po_bound([s], [mb], cfg.m2po_threshold) != one for s, mb in zip(starts, mbs))
    denom = replace(L.denominators(mbs), m2_max=one)  # train.prepare counts the whole batch on every rank
    results = []
    for parts in ([[0, 1, 2, 3]], ranks):
        loss, total = 0.0, {}
        for r in parts:
            for i in r:
                logp, slogp, ent = head(logits[i], mbs[i])
                l, m = L.rl_loss(logp, slogp, ent, mbs[i], cfg, denom, STEP)
                loss = loss + l
                accumulate(total, m)
        results.append((loss, grads(loss, leaves), reduce_metrics(total)))
    (l1, g1, m1), (l2, g2, m2) = results
    assert 0 < m1["m2po/masked_fraction"] < 1
    assert torch.allclose(l1, l2, rtol=1e-12) and all(torch.allclose(a, b, rtol=1e-12, atol=1e-15) for a, b in zip(g1, g2))
    assert_metrics_close(m1, m2, tol=1e-12)


def test_m2po_drops_ties_together_and_keeps_the_mean_under_tau():
    """Values by hand: (log r)^2 = 0.01, 0.04, 0.25, 0.25, 1.0 with tau 0.1: the mean of the three smallest,
    0.17, passes tau, so both 0.25s go (a bound on the value); the rest's mean 0.025 is <= tau."""
    lr = [0.1, -0.2, 0.5, -0.5, 1.0]
    mb, lp = docs_batch([[-1.0 + x for x in lr]], [[-1.0] * 5], [1.0], dtype=F64)
    assert m2po_bound([lp.detach()], [mb], 0.1) == pytest.approx(0.04)
    assert m2po_bound([lp.detach()], [mb], 0.005) == -1.0  # not even the smallest fits: every token goes
    assert m2po_bound([lp.detach()], [mb], 10.0) == pytest.approx(1.0)


# ----------------------------------------------------------------------------- 4. overflowing ratios

@pytest.mark.parametrize("masks", ["off", "seq+kl", "metrics-only"])
@pytest.mark.parametrize("kl", ["no-kl", "exact"])
@pytest.mark.parametrize("variant", ["reinforce", "icepop", "ipo", "tis", "ppo", "ppo+icepop+sg", "cispo",
                                     "cispo+icepop+sg", "gspo", "gspo+icepop+sg", "sapo", "sapo+icepop+sg", "topr"])
def test_log_ratio_of_1000(variant, kl, masks):
    loss_type, icepop, _ = VARIANTS[variant]
    extra = {"off": {}, "seq+kl": dict(seq_mask="geometric", kl_mask="binary"),
             "metrics-only": dict(correction_metrics_only=True, seq_mask="max", kl_mask="k1")}[masks]
    cfg = cfg_for(loss_type, icepop_mask=icepop, **KLS[kl], **extra)
    docs = make_docs("draws", seed=3)
    d, hi, lo = docs[0], 3, 4  # two completion positions of sample 0
    with torch.no_grad():  # hi: p(a) ~ 1, the sampler says log q = -1000; lo: log p(a) ~ -1000, q = 1
        d.logits[hi] = 0.0
        d.logits[hi, 2] = 10.0
        d.logits[lo] = 0.0
        d.logits[lo, 3] = -1000.0 * TEMP
    d.labels[hi], d.logq[hi], d.rows[hi] = 2, -1000.0, ([2] * K, [-1000.0] * K)
    d.labels[lo], d.logq[lo], d.rows[lo] = 3, 0.0, ([3] * K, [0.0] * K)  # q(a) = 1: every draw is a
    mb, logits, _ = assemble(docs, T=24)
    loss, metrics = run_loss([mb], [logits], cfg)
    grad = torch.autograd.grad(loss, d.logits)[0]
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    if masks == "seq+kl" and kl == "no-kl":  # both tokens flagged, so the whole sequence goes
        assert (grad == 0).all() and 0 < metrics["kl_mask/masked_fraction"] < 1, metrics
    elif masks == "off" and kl == "no-kl" and (loss_type in ("icepop", "ipo") or icepop):
        assert (grad[[hi, lo]] == 0).all()
        assert grad.abs().sum() > 0  # the other tokens still train


@pytest.mark.parametrize("loss_type", ["ppo", "cispo", "gspo", "sapo"])
def test_masked_token_with_overflowing_rho(loss_type):
    """pi_old = p * e^-1000 on one token: rho overflows, M(k) masks it; it must add exactly 0."""
    cfg = cfg_for(loss_type, icepop_mask=True)
    docs = make_docs("replayed")
    mb, logits, _ = assemble(docs, T=24)
    pos = doc_pos(docs, 0, 1)
    mb.advantages[pos] = -1.0  # the side where min(rho*A, clip(rho)*A) keeps the unbounded rho*A
    logp, slogp, ent = head(logits, mb)
    old = logp.detach().clone()
    old[pos] -= 1000.0
    loss, m = L.rl_loss(logp, slogp, ent, mb, cfg, L.denominators([mb]), STEP, old_logp=old)
    grad = torch.autograd.grad(loss, logits)[0]
    assert torch.isfinite(loss) and torch.isfinite(grad).all() and (grad[pos] == 0).all()
    assert all(math.isfinite(v) for v in reduce_metrics(m).values())


def one_doc_batch(logp: list[float], logq: list[float], adv: float = 1.0) -> MicroBatch:
    """n loss tokens in one document, no support; logq kept in fp64 so log r is exact."""
    n = len(logp)
    z = torch.zeros(n, dtype=torch.int64)
    return MicroBatch(z, torch.arange(n), z, z, torch.ones(n, dtype=torch.bool), torch.full((n,), adv),
                      torch.tensor(logq, dtype=F64), torch.full((n,), STEP), z, None, n, [0])


def docs_batch(logp: list[list[float]], logq: list[list[float]], adv: list[float], pad: int = 0,
               dtype=torch.float32) -> tuple[MicroBatch, torch.Tensor]:
    """One document per list, loss tokens only, no support; (mb, logp leaf)."""
    ns = [len(x) for x in logp]
    doc_ids = torch.cat([torch.full((n,), j) for j, n in enumerate(ns)] + [torch.full((pad,), len(ns))])
    T = doc_ids.numel()
    mask = torch.arange(T) < sum(ns)
    flat = lambda xs, fill: torch.tensor([v for x in xs for v in x] + [fill] * pad, dtype=dtype)
    advs = flat([[a] * n for a, n in zip(adv, ns)], 0.0)
    z = torch.zeros(T, dtype=torch.int64)
    mb = MicroBatch(z, z, doc_ids, z, mask, advs, flat(logq, 0.0), torch.full((T,), STEP),
                    torch.where(mask, doc_ids, -1), None, int(mask.sum()), list(range(len(ns))))
    return mb, flat(logp, 0.0).requires_grad_()


def test_long_sequence_with_one_ratio_of_e50():
    """4,000 tokens at log r = 0.01 and one at log r = 50: the raw product of the ratios overflows
    fp32, the geometric mean does not, and --seq-mask removes exactly that sequence."""
    n, lp = 4000, math.log(0.6)
    lrs = [[0.01] * n, [0.01] * 10, [0.01] * 10]
    lrs[0][1234] = 50.0
    logq = [[lp - x for x in d] for d in lrs]
    mb, logp = docs_batch([[lp] * len(d) for d in lrs], logq, [1.0, -1.0, 0.5], pad=4)
    log_r = (logp - mb.logq).detach()
    doc0 = mb.doc_ids == 0
    assert torch.isinf(log_r[doc0].sum().exp())  # why a raw product is not offered
    mean0 = log_r[doc0].double().mean().item()  # (3999 * 0.01 + 50) / 4000; the others' is 0.01
    assert math.log(1.02) < mean0 < 0.03
    denom = L.denominators([mb])

    def run(loss_type: str = "reinforce", **kw):
        loss, m = L.rl_loss(logp, logp.new_zeros(0), torch.zeros_like(logp), mb, cfg_for(loss_type, **kw), denom, STEP)
        return loss, torch.autograd.grad(loss, logp)[0], reduce_metrics(m)

    for mode, high in (("geometric", 1.02), ("max", 1.02), ("geometric", math.exp(mean0 - 1e-4))):
        loss, g, m = run(seq_mask=mode, seq_mask_low=0.98, seq_mask_high=high)
        assert torch.isfinite(loss) and torch.isfinite(g).all()
        assert (g[doc0] == 0).all() and (g[mb.loss_mask & ~doc0] != 0).all()
        assert m["seq_mask/masked_fraction"] == pytest.approx(n / (n + 20))
    _, g, m = run(seq_mask="geometric", seq_mask_low=0.98, seq_mask_high=math.exp(mean0 + 1e-4))
    assert m["seq_mask/masked_fraction"] == 0 and (g[mb.loss_mask] != 0).all()  # the mean is exact
    for loss_type in ("reinforce", "tis", "icepop", "ipo"):  # --seq-mask off: finite; that token's weight
        loss, g, _ = run(loss_type)
        c = cfg_for(loss_type)
        assert torch.isfinite(loss) and torch.isfinite(g).all()
        want = {"reinforce": 1.0, "tis": c.tis_cap, "icepop": 0.0, "ipo": 0.0}[loss_type]
        assert g[1234].item() == pytest.approx(-want * c.adv_tau / denom.tokens, rel=1e-6)


@pytest.mark.parametrize("depth", [200.0, 800.0])  # k = e^-200 underflows fp32 (e^-104), e^-800 fp64 too (e^-745)
@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["fp32", "fp64"])
def test_gspo_keeps_a_token_whose_weight_underflows_in_the_mean(dtype, depth):
    """--icepop-alpha 0 keeps k = pi_old/q however small, so the token stays in s's mean
    (decided in log space, not from M > 0 after exp). One sample, log q = [-1, -1], A = 1, epochs 1,
    log p = [-1, -1 - depth]: s = 1 and dL/dlog p = -A*(M_1 + M_2)/(|y| * N) = -0.25 on both tokens."""
    mb, logp = docs_batch([[-1.0, -1.0 - depth]], [[-1.0, -1.0]], [1.0], dtype=dtype)
    cfg = Config(loss="gspo", icepop_mask=True, icepop_alpha=0.0)
    loss, m = L.rl_loss(logp, logp.new_zeros(0), torch.zeros_like(logp), mb, cfg, L.denominators([mb]), STEP)
    g = torch.autograd.grad(loss, logp)[0]
    assert g.tolist() == pytest.approx([-0.25, -0.25], rel=1e-6)
    assert reduce_metrics(m)["icepop/masked_fraction"] == 0


@pytest.mark.parametrize("depth", [200.0, 800.0])
@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["fp32", "fp64"])
def test_ppo_weight_that_underflows_meets_a_large_ratio(dtype, depth):
    """The same underflow in ppo: M = k = e^-depth kept (alpha 0), rho = p/pi_old = e^depth, A = -1
    (the unclipped side): the term -M*rho*A = 1 and its gradient 1, however either factor rounds alone."""
    mb, logp = docs_batch([[-1.0]], [[-1.0]], [-1.0], dtype=dtype)
    old = logp.detach() - depth
    cfg = Config(loss="ppo", icepop_mask=True, icepop_alpha=0.0)
    loss, _ = L.rl_loss(logp, logp.new_zeros(0), torch.zeros_like(logp), mb, cfg, L.denominators([mb]), STEP,
                        old_logp=old)
    g = torch.autograd.grad(loss, logp)[0]
    assert loss.item() == pytest.approx(1.0, rel=1e-6) and g.tolist() == pytest.approx([1.0], rel=1e-6)


def test_metrics_only_trains_plain_reinforce():
    """--correction-metrics-only changes no gradient: whatever --loss and the masks say, it is reinforce."""
    for kind in ("replayed", "draws"):
        docs = make_docs(kind)
        mb, logits, noise = assemble(docs, T=24)
        out = []
        for cfg in (cfg_for("reinforce", **KLS["exact"]),
                    cfg_for("ppo", icepop_mask=True, seq_mask="geometric", kl_mask="k3", correction_metrics_only=True,
                            **KLS["exact"])):
            loss, m = run_loss([mb], [logits], cfg, old_list=[noise])
            out.append((loss, torch.autograd.grad(loss, logits)[0], m))
        (l0, g0, m0), (l1, g1, m1) = out
        assert torch.equal(l0, l1) and torch.equal(g0, g1)
        assert {k: v for k, v in m1.items() if not k.startswith("correction/")} == m0
        assert 0 < m1["correction/would_mask/icepop"] < 1 and m1["correction/would_mask/kl_k3"] > 0


@pytest.mark.parametrize("seq_mask", ["off", "geometric"])
def test_would_mask_fractions_by_hand(seq_mask):
    """Six tokens in three sequences, (p, q) of each sampled token chosen by hand."""
    pq = [[(0.5, 0.5), (0.6, 0.2), (0.3, 0.45)], [(0.85, 0.8), (0.1, 0.25)], [(0.4, 0.4)]]
    #  r:   1          3           2/3            1.0625       0.4           1
    logp = [[math.log(p) for p, _ in d] for d in pq]
    logq = [[math.log(q) for _, q in d] for d in pq]
    mb, lp = docs_batch(logp, logq, [1.0, -1.0, 2.0], pad=2, dtype=F64)
    cfg = cfg_for("icepop", icepop_alpha=0.5, icepop_beta=2.0, ipo_eps=0.1, tis_cap=1.5, seq_mask=seq_mask,
                  seq_mask_low=0.7, seq_mask_high=1.3, kl_mask_threshold=0.3, correction_metrics_only=True)
    loss, m = L.rl_loss(lp, lp.new_zeros(0), torch.zeros_like(lp), mb, cfg, L.denominators([mb]), STEP)
    m = reduce_metrics(m)
    whole = seq_mask != "off"  # under --seq-mask a flagged token takes its whole sequence
    want = {"icepop": 2 / 6,  # r = 3 and 0.4 outside [0.5, 2]
            "ipo": 3 / 6,  # |p - q| = 0.4, 0.15, 0.15 > 0.1
            "tis_clip": 1 / 6,  # r = 3 > 1.5
            "seq_geometric": 2 / 6,  # geometric means 2^(1/3) = 1.26, sqrt(0.425) = 0.65 (masked), 1
            "seq_max": 5 / 6,  # r = 3 and 0.4 leave [0.7, 1.3]
            "kl_k1": (5 if whole else 3) / 6,  # |log r| = 1.10, 0.41, 0.92 > 0.3
            "kl_k3": (5 if whole else 2) / 6,  # r - 1 - log r = 0.90 (r = 3), 0.32 (r = 0.4)
            "kl_binary": (3 if whole else 1) / 6}  # 0.33 for (0.6, 0.2); 0.05, 0.01, 0.09 for the others
    for k, v in want.items():
        assert m[f"correction/would_mask/{k}"] == pytest.approx(v, abs=1e-12), k
    rs = [[p / q for p, q in d] for d in pq]
    flat = [r for d in rs for r in d]
    assert m["correction/ratio"] == pytest.approx(sum(flat) / 6, rel=1e-12)
    assert m["correction/chi2"] == pytest.approx(sum(r * r for r in flat) / 6 - 1, rel=1e-12)
    ess = [sum(d) ** 2 / (len(d) * sum(r * r for r in d)) for d in rs]  # 0.695, 0.830, 1
    assert m["correction/ess"] == pytest.approx(sum(ess) / 3, rel=1e-12)
    adv = torch.tensor([1, 1, 1, -1, -1, 2], dtype=F64) * cfg.adv_tau
    assert torch.allclose(torch.autograd.grad(loss, lp)[0][:6], -adv / 6, rtol=1e-12)  # plain reinforce


def test_correction_flags_are_checked():
    """The masks' flags at parse time (Config); a loss's own flags from its LOSSES row (loss.check_flags, at
    the start checks), each with the line naming the flag."""
    for kw, flag in ((dict(tis_cap=0.9), "--tis-floor/--tis-cap"), (dict(tis_floor=1.5), "--tis-floor/--tis-cap"),
                     (dict(ipo_eps=0.0), "--ipo-eps must be > 0"), (dict(clip_low=1.0), "--clip-low must be in"),
                     (dict(icepop_alpha=float("nan")), "--icepop-alpha must be a finite number, got nan"),
                     (dict(tis_floor=1e39), "--tis-floor must be a finite number in float32"),
                     (dict(seq_mask_low=1.0), "--seq-mask-low"), (dict(seq_mask_high=0.9), "--seq-mask-high"),
                     (dict(kl_mask_threshold=0.0), "--kl-mask-threshold"),
                     (dict(sapo_tau_neg=0.0), "--sapo-tau-pos/--sapo-tau-neg need both > 0"),
                     (dict(sapo_tau_pos=float("inf")), "--sapo-tau-pos must be a finite number"),
                     (dict(log_ratio_coeff=-0.1), "--log-ratio-coeff must be >= 0"),
                     (dict(m2po_threshold=-0.1), "--m2po-threshold must be >= 0"),
                     (dict(m2po_threshold=float("inf")), "--m2po-threshold must be a finite number"),
                     (dict(log_ratio_coeff=float("nan")), "--log-ratio-coeff must be a finite number"),
                     (dict(kl_mask_directional=True), "--kl-mask-directional has no effect with --kl-mask off")):
        with pytest.raises(ConfigError, match=flag):
            L.check_flags(Config(**kw))
    L.check_flags(Config(tis_cap=float("inf"), max_importance_ratio=float("inf")))  # inf: no cap


@pytest.mark.parametrize("kind, threshold", [("binary_tv", 0.2), ("binary", 0.3)])
def test_dppo_directional_mask_by_hand(kind, threshold):
    """DPPO (arXiv 2602.04879): a token leaves only when its divergence passes delta AND A pushes p(a) further
    from q(a). Five one-token sequences, (p, q, A) by hand; TV = |p - q| = 0.4, 0.4, 0.4, 0.4, 0.05 and binary
    KL(Bern(q)||Bern(p)) = 0.51, 0.51, 0.38, 0.38, 0.005: the first four pass delta, two of them unsafely."""
    pqa = [(0.9, 0.5, 1.0), (0.9, 0.5, -1.0), (0.2, 0.6, -1.0), (0.2, 0.6, 1.0), (0.55, 0.5, 1.0)]
    mb, lp = docs_batch([[math.log(p)] for p, _, _ in pqa], [[math.log(q)] for _, q, _ in pqa],
                        [a for _, _, a in pqa], pad=1, dtype=F64)
    adv = torch.tensor([a for _, _, a in pqa], dtype=F64) * 1.3
    for directional, masked in ((False, [1, 1, 1, 1, 0]), (True, [1, 0, 1, 0, 0])):
        cfg = cfg_for("reinforce", kl_mask=kind, kl_mask_threshold=threshold, kl_mask_directional=directional)
        loss, m = L.rl_loss(lp, lp.new_zeros(0), torch.zeros_like(lp), mb, cfg, L.denominators([mb]), STEP)
        g = torch.autograd.grad(loss, lp)[0][:5]
        kept = 1 - torch.tensor(masked, dtype=F64)
        assert torch.allclose(g, -adv * kept / 5, rtol=1e-12, atol=0)  # plain reinforce on the kept tokens
        assert reduce_metrics(m)["kl_mask/masked_fraction"] == pytest.approx(sum(masked) / 5, abs=1e-15)


def test_sapo_gate_by_hand():
    """SAPO's gradient on log p(a): -A*4*s*(1 - s)*rho per token, s = sigmoid(tau*(rho - 1)), tau by A's sign;
    the plain policy gradient -A at rho = 1, and the same rho fades faster under the larger tau_neg."""
    mb, lp = docs_batch([[-1.0], [-1.0], [-1.0], [-1.0]], [[-1.0]] * 4, [1.0, -1.0, 1.0, -1.0], dtype=F64)
    old = lp.detach() - torch.tensor([0.5, 0.5, 0.0, 0.0], dtype=F64)  # rho = e^0.5 on the first two, 1 on the rest
    cfg = Config(loss="sapo", sapo_tau_pos=1.0, sapo_tau_neg=3.0)
    loss, m = L.rl_loss(lp, lp.new_zeros(0), torch.zeros_like(lp), mb, cfg, L.denominators([mb]), STEP, old_logp=old)
    g = torch.autograd.grad(loss, lp)[0]
    want = []
    for A, log_rho in ((1.0, 0.5), (-1.0, 0.5), (1.0, 0.0), (-1.0, 0.0)):
        tau, rho = (1.0 if A > 0 else 3.0), math.exp(log_rho)
        s = 1 / (1 + math.exp(-tau * (rho - 1)))
        want.append(-A * 4 * s * (1 - s) * rho / 4)
    assert g.tolist() == pytest.approx(want, rel=1e-12)
    assert want[2:] == [-0.25, 0.25] and abs(want[1]) < abs(want[0])


def test_log_ratio_term_by_hand():
    """Kimi K2.5's tau*(log r)^2 adds 2*tau*log r to dL/dlog p(a): r = p/q under tis, p/pi_old under ppo."""
    mb, lp = docs_batch([[-1.0, -2.0]], [[-1.5, -1.0]], [1.0], dtype=F64)
    old = lp.detach() + torch.tensor([0.2, -0.1], dtype=F64)
    for loss_type, log_r in (("tis", [0.5, -1.0]), ("ppo", [-0.2, 0.1])):
        out = []
        for tau in (0.0, 0.7):
            cfg = Config(loss=loss_type, tis_cap=10.0, clip_low=0.9, clip_high=10.0, log_ratio_coeff=tau)
            loss, m = L.rl_loss(lp, lp.new_zeros(0), torch.zeros_like(lp), mb, cfg, L.denominators([mb]), STEP,
                                old_logp=old)
            out.append((loss, torch.autograd.grad(loss, lp)[0], reduce_metrics(m)))
        (l0, g0, _), (l1, g1, m1) = out
        assert (l1 - l0).item() == pytest.approx(0.7 * sum(x * x for x in log_r) / 2, rel=1e-12)
        assert (g1 - g0).tolist() == pytest.approx([2 * 0.7 * x / 2 for x in log_r], rel=1e-12)
        assert m1["log_ratio_sq"] == pytest.approx(sum(x * x for x in log_r) / 2, rel=1e-12)


def test_topr_weights_by_hand():
    """TOPR: w = 1 on a sequence with A >= 0 whatever its ratio; min(1, prod p/q) with A < 0."""
    lq = [[-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0]]
    lp = [[-0.8, -0.9], [-1.5, -1.2], [2.0 - 1.0, -1.0]]  # log prod r = 0.3 (truncated to 1), -0.7, 2 (A > 0)
    mb, logp = docs_batch(lp, lq, [-1.0, -1.0, 1.0], dtype=F64)
    loss, m = L.rl_loss(logp, logp.new_zeros(0), torch.zeros_like(logp), mb, Config(loss="topr"), L.denominators([mb]),
                        STEP)
    g = torch.autograd.grad(loss, logp)[0]
    w = [1.0, 1.0, math.exp(-0.7), math.exp(-0.7), 1.0, 1.0]
    A = [-1.0, -1.0, -1.0, -1.0, 1.0, 1.0]
    assert g.tolist() == pytest.approx([-a * x / 6 for a, x in zip(A, w)], rel=1e-12)
    assert reduce_metrics(m)["topr/clip_fraction"] == pytest.approx(2 / 6, abs=1e-15)


def test_icepop_bounds_are_inclusive():
    a, b = math.log(0.5), math.log(2.0)
    mb = one_doc_batch([a, b, a - 1e-9, b + 1e-9], [0.0] * 4)
    logp = torch.tensor([a, b, a - 1e-9, b + 1e-9], dtype=F64, requires_grad=True)
    loss, m = L.rl_loss(logp, logp.new_zeros(0), torch.zeros(4), mb, cfg_for("icepop", adv_tau=1.0),
                        L.denominators([mb]), STEP)
    m = reduce_metrics(m)
    assert m["icepop/masked_fraction/low"] == m["icepop/masked_fraction/high"] == 0.25
    assert torch.allclose(torch.autograd.grad(loss, logp)[0], torch.tensor([-0.5, -2.0, 0, 0], dtype=F64) / 4)


def test_garbage_outside_the_loss_is_ignored():
    """Prompt and padding positions are never checked and never reach the loss."""
    _, _, mbs = evidence_batches()
    assert not mbs[0].loss_mask[0] and not mbs[1].loss_mask[13:].any()
    mbs[0].logq[0], mbs[1].logq[13], mbs[1].logq[14] = float("nan"), 3.0, -float("inf")
    mbs[1].advantages[13:] = float("nan")
    E.validate(mbs, V, cfg_for("icepop"))
    logits = [torch.randn(16, V, dtype=F64, requires_grad=True) for _ in mbs]
    for variant in ("ipo", "ppo+icepop"):
        loss_type, icepop, _ = VARIANTS[variant]
        loss, m = run_loss(mbs, logits, cfg_for(loss_type, icepop_mask=icepop, **KLS["k1"]))
        assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in torch.autograd.grad(loss, logits))
        assert all(math.isfinite(v) for v in m.values())


# ----------------------------------------------------------------------------- 5, 6. peer-bug regressions

def fully_masked_token(agg: str, loss_type: str = "icepop"):
    """A replayed row {a, b} with q = (0.9, 0.1) and renormalized p = (0.1, 0.9): r = (1/9, 9)."""
    docs = make_docs("replayed", seed=5)
    d, t = docs[1], 2
    with torch.no_grad():
        d.logits[t] = torch.randn(V, dtype=F64)
        d.logits[t, 0], d.logits[t, 1] = math.log(0.1) * TEMP, math.log(0.9) * TEMP
    d.labels[t], d.logq[t], d.rows[t] = 0, math.log(0.9), ([0, 1], [math.log(0.9), math.log(0.1)])
    mb, logits, _ = assemble(docs, T=24)
    return docs, mb, logits, cfg_for(loss_type, loss_agg=agg), docs[0].labels.numel() + t


@pytest.mark.parametrize("agg", ["sequence", "token"])
def test_icepop_mask_holds_under_both_aggregations(agg):
    """IcePop silently ignored under sequence aggregation was a peer bug."""
    for loss_type in ("icepop", "reinforce"):
        docs, mb, logits, cfg, pos = fully_masked_token(agg, loss_type)
        grads = []
        for scale in (1.0, -50.0):  # the masked token's advantage must not matter
            mb2 = replace(mb, advantages=mb.advantages.clone())
            mb2.advantages[pos] *= scale
            loss, _ = run_loss([mb2], [logits], cfg)
            grads.append(torch.autograd.grad(loss, logits)[0])
        if loss_type == "icepop":
            assert torch.equal(grads[0], grads[1]) and (grads[0][pos] == 0).all()
        else:  # the same token does train under reinforce, so the check above can fail
            assert not torch.allclose(grads[0], grads[1])


def test_masked_fraction_is_a_fraction_over_micro_batches():
    """`1 - mean` per micro-batch summed to N - x over N micro-batches in a peer."""
    cfg = cfg_for("icepop")
    docs = make_docs("draws", seed=11, shapes=[(2, 5), (3, 4), (2, 6), (3, 5)])
    parts = [assemble([d], T=8) for d in docs]
    mbs, logits, _ = zip(*parts)
    _, metrics = run_loss(list(mbs), list(logits), cfg)
    masked = total = 0
    for mb, lg in zip(mbs, logits):
        logp, _, _ = head(lg, mb)
        r = (logp.detach() - mb.logq.double()).exp()[mb.loss_mask]
        masked += int(((r < cfg.icepop_alpha) | (r > cfg.icepop_beta)).sum())
        total += r.numel()
    assert 0 < masked < total
    assert metrics["icepop/masked_fraction"] == pytest.approx(masked / total, abs=1e-12)


def test_masked_tokens_stay_in_the_denominator():
    """Removing masked tokens from the denominator changed the loss scale in a peer."""
    docs, mb, logits, cfg, pos = fully_masked_token("token")
    denom = L.denominators([mb])
    assert denom.tokens == int(mb.loss_mask.sum())
    loss, _ = run_loss([mb], [logits], cfg)
    without = replace(mb, loss_mask=mb.loss_mask.clone())
    without.loss_mask[pos] = False
    rest, _ = run_loss([without], [logits], cfg, denom=L.Denominators(1, 1))  # sum over the other tokens
    assert torch.allclose(loss, rest / denom.tokens, rtol=1e-12)
    assert not torch.allclose(loss, rest / (denom.tokens - 1), rtol=1e-6)


# ----------------------------------------------------------------------------- 7. evidence

def doc_pos(docs: list[Doc], j: int, k: int) -> int:
    """Position of sample j's k-th completion token in the assembled buffer."""
    start = sum(d.labels.numel() for d in docs[:j])
    return start + int(torch.nonzero(docs[j].mask)[0]) + k


def entry_of(mb: MicroBatch, pos: int, j: int = 0) -> int:
    return int(mb.support.host_offsets[pos]) + j


def row_slice(mb: MicroBatch, pos: int) -> slice:
    return slice(int(mb.support.host_offsets[pos]), int(mb.support.host_offsets[pos + 1]))


def _replayed_row_without_label(docs, mb, pos):
    ids = mb.support.ids[row_slice(mb, pos)]  # a view: overwrite the label's entry with another kept id
    j = int((ids == mb.labels[pos]).int().argmax())
    ids[j] = ids[(j + 1) % ids.numel()]


def _replayed_q_off(docs, mb, pos):
    lq = mb.support.logq[row_slice(mb, pos)]
    lq[int(lq.argmax())] -= 0.5  # the largest q >= 1/V, so the sum moves by > 1e-3


BAD = {  # name: (mutation of (docs, mb, pos), words of the check in the message); sample 1, token 2
    "nan-logq": (lambda docs, mb, pos: mb.logq.__setitem__(pos, float("nan")), "logq is not finite"),
    "positive-logq": (lambda docs, mb, pos: mb.logq.__setitem__(pos, 0.5), "logq > 0"),
    "label-out-of-range": (lambda docs, mb, pos: mb.labels.__setitem__(pos, V), "label not in"),
    "id-out-of-range": (lambda docs, mb, pos: mb.support.ids.__setitem__(entry_of(mb, pos, 1), V),
                        "support id not in"),
    "support-logq-nan": (lambda docs, mb, pos: mb.support.logq.__setitem__(entry_of(mb, pos), float("nan")),
                         "support logq is not finite"),
    "support-positive-logq": (lambda docs, mb, pos: mb.support.logq.__setitem__(entry_of(mb, pos), 0.3),
                              "support logq > 0"),
    "replayed-without-label": (_replayed_row_without_label, "replayed row lacks its sampled token"),
    "replayed-q-sum": (_replayed_q_off, "replayed q does not sum to 1"),
}


def evidence_batches(seed: int = 13):
    """Two micro-batches: replayed samples 0-2 in one, draws samples 3-5 in the other."""
    rep = make_docs("replayed", seed=seed, shapes=[(2, 4), (3, 5), (2, 3)])
    dr = make_docs("draws", seed=seed + 1, shapes=[(2, 3), (3, 4), (2, 2)])
    for s, d in enumerate(dr):
        d.sample = 3 + s
    return rep, dr, [assemble(rep, T=16)[0], assemble(dr, T=16)[0]]


def test_valid_evidence_passes():
    _, _, mbs = evidence_batches()
    for mode in ("error", "drop"):
        m = reduce_metrics(E.validate(mbs, V, cfg_for("icepop", bad_evidence=mode)))
        assert m == {"bad_evidence/dropped": 0.0}
    assert all(mb.loss_mask.sum() == mb.num_loss_tokens for mb in mbs)


def bad_batches(case: str):
    rep, dr, mbs = evidence_batches()
    if case == "draws-row-size":  # sample 4 (draws), token 2 has K + 1 draws
        ids, lqs = dr[1].rows[dr[1].mask.nonzero()[2].item()]
        dr[1].rows[dr[1].mask.nonzero()[2].item()] = (ids + ids[:1], lqs + lqs[:1])
        return [mbs[0], assemble(dr, T=16)[0]], 4, "draws row size"
    if case == "empty-draws-row":  # sample 4 (draws), token 2 has no draws: centering and sparse need them
        dr[1].rows[dr[1].mask.nonzero()[2].item()] = ([], [])
        return [mbs[0], assemble(dr, T=16)[0]], 4, "draws row is empty"
    mutate, words = BAD[case]
    mutate(rep, mbs[0], doc_pos(rep, 1, 2))
    return mbs, 1, words


CASES = [*BAD, "draws-row-size", "empty-draws-row"]


@pytest.mark.parametrize("case", CASES)
def test_bad_evidence_raises_naming_sample_and_check(case):
    mbs, sample, words = bad_batches(case)
    before = [mb.loss_mask.clone() for mb in mbs]
    with pytest.raises(ValueError, match="bad sampler evidence") as e:
        E.validate(mbs, V, cfg_for("icepop"))
    assert f"sample {sample}, token 2: " in str(e.value) and words in str(e.value)
    assert all(torch.equal(mb.loss_mask, b) for mb, b in zip(mbs, before))  # error mode changes nothing


@pytest.mark.parametrize("case", CASES)
def test_bad_evidence_drop(case):
    mbs, sample, _ = bad_batches(case)
    before = [mb.loss_mask.clone() for mb in mbs]
    metrics = reduce_metrics(E.validate(mbs, V, cfg_for("icepop", bad_evidence="drop")))
    assert metrics["bad_evidence/dropped"] == pytest.approx(1 / 6)
    for mb, was in zip(mbs, before):
        gone = mb.sample_idx == sample
        assert not mb.loss_mask[gone].any() and torch.equal(mb.loss_mask[~gone], was[~gone])
        assert mb.num_loss_tokens == int(mb.loss_mask.sum())
    assert L.denominators(mbs).tokens == sum(int(w.sum()) for w in before) - sum(
        int((w & (mb.sample_idx == sample)).sum()) for mb, w in zip(mbs, before))
    # what the dropped sample held (NaN, ids out of range) reaches neither the head nor the gradient
    logits = [torch.randn(16, V, dtype=F64, requires_grad=True) for _ in mbs]
    loss, m = run_loss(mbs, logits, cfg_for("icepop", **KLS["exact"]))
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in torch.autograd.grad(loss, logits))
    assert all(math.isfinite(v) for v in m.values())


def test_an_empty_draws_row_is_fine_for_a_loss_that_reads_no_row():
    mbs, _, _ = bad_batches("empty-draws-row")
    assert reduce_metrics(E.validate(mbs, V, cfg_for("ppo"))) == {"bad_evidence/dropped": 0.0}


def test_broken_offsets_raise_even_when_dropping():
    _, _, mbs = evidence_batches()
    mbs[1].support.offsets[5] = mbs[1].support.offsets[4] - 1
    with pytest.raises(ValueError, match="offsets"):
        E.validate(mbs, V, cfg_for("icepop", bad_evidence="drop"))


class HostWaits(TorchDispatchMode):
    """Counts what would make the host wait for an accelerator. On the CPU nothing waits, so
    we count the operations that would: reading a value (.item(), bool(), int() and float()
    all lower to _local_scalar_dense), outputs whose size depends on data (nonzero,
    masked_select, unique, bool-mask indexing, repeat_interleave without output_size),
    plus .tolist()/.numpy()/.cpu(), which copy to host memory without dispatching an op
    on a CPU tensor (patched below)."""

    DATA_SIZED = {aten.nonzero.default, aten.masked_select.default, aten._unique2.default,
                  aten.unique_consecutive.default, aten.unique_dim.default}

    def __init__(self, monkeypatch):
        super().__init__()
        self.events: list[str] = []
        for name in ("tolist", "numpy", "cpu"):
            orig = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._counted(name, orig))

    def _counted(self, name, orig):
        def f(t, *a, **kw):
            self.events.append(name)
            return orig(t, *a, **kw)
        return f

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        bool_index = func is aten.index.Tensor and any(
            i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1])
        unsized = func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None
        if func is aten._local_scalar_dense.default or func in self.DATA_SIZED or bool_index or unsized:
            self.events.append(str(func))
        return func(*args, **kwargs)


def test_host_syncs(monkeypatch):
    _, _, mbs = evidence_batches()
    cfg = cfg_for("ppo", icepop_mask=True, bad_evidence="drop", **KLS["exact"])
    logits = [torch.randn(16, V, dtype=F64, requires_grad=True) for _ in mbs]
    heads = [head(lg, mb) for lg, mb in zip(logits, mbs)]
    with HostWaits(monkeypatch) as w:
        E.validate(mbs, V, cfg)
        assert w.events == ["tolist"]  # exactly one, at the end
        w.events.clear()
        denom = L.denominators(mbs)
        assert w.events == ["tolist"]
        w.events.clear()
        total = {}
        for mb, (logp, slogp, ent) in zip(mbs, heads):
            for c in (cfg, replace(cfg, loss="icepop", loss_agg="sequence"),
                      replace(cfg, loss="tis", seq_mask="geometric", kl_mask="binary"),
                      replace(cfg, seq_mask="max", kl_mask="k1"), replace(cfg, correction_metrics_only=True),
                      replace(cfg, loss="sapo", kl_mask="binary_tv", kl_mask_directional=True, log_ratio_coeff=0.1),
                      replace(cfg, loss="topr", kl_mask="binary", kl_mask_directional=True, log_ratio_coeff=0.1)):
                _, m = L.rl_loss(logp, slogp, ent, mb, c, denom, STEP, old_logp=logp.detach() - 0.1)
                accumulate(total, m)
        assert w.events == []  # none inside the micro-batch loop
        reduce_metrics(total)
        assert w.events == ["tolist"]


# ----------------------------------------------------------------------------- sft

def test_sft_loss_is_global_mean_nll():
    _, _, mbs = evidence_batches()
    logits = [torch.randn(16, V, dtype=F64, requires_grad=True) for _ in mbs]
    denom, total, metrics, nll = L.denominators(mbs), 0.0, {}, []
    for mb, lg in zip(mbs, logits):
        logp = torch.log_softmax(lg, -1).gather(1, mb.labels[:, None])[:, 0]
        loss, m = L.sft_loss(logp, mb, denom)
        total = total + loss
        accumulate(metrics, m)
        nll.append(-logp[mb.loss_mask])
    want = torch.cat(nll).mean()
    assert torch.allclose(total, want, rtol=1e-12)
    assert reduce_metrics(metrics)["loss"] == pytest.approx(want.item(), rel=1e-12)


def test_gspo_ratio_is_the_sequence_s_and_matters_from_the_second_epoch():
    """At pi_old = sg(p) (s = 1) gspo's gradient is the plain policy gradient, -A/(|y|*N_seq) per
    token under --loss-agg sequence; with pi_old off p every token of a sequence shares one s."""
    docs = make_docs("draws", seed=11)
    mb, logits, noise = assemble(docs, T=24, with_support=False)
    cfg = cfg_for("gspo", loss_agg="sequence", clip_low=0.9, clip_high=10.0)  # no clip acts
    logp, slogp, ent = head(logits, mb)
    loss, _ = L.rl_loss(logp, slogp, ent, mb, cfg, L.denominators([mb]), STEP)
    g = torch.autograd.grad(loss, logp)[0]
    n = L.sum_by(mb.doc_ids, mb.loss_mask.double(), len(mb.doc_ids))[mb.doc_ids]
    want = torch.where(mb.loss_mask, -mb.advantages.double() * cfg.adv_tau / (n * L.denominators([mb]).seqs), 0.0)
    assert torch.allclose(g, want, rtol=1e-12, atol=1e-15)
    old = logp.detach() + noise
    loss, _ = L.rl_loss(logp, slogp, ent, mb, cfg, L.denominators([mb]), STEP, old_logp=old)
    g = torch.autograd.grad(loss, logp)[0]
    for d in mb.doc_ids[mb.loss_mask].unique():
        on = mb.loss_mask & (mb.doc_ids == d)
        s = torch.exp((logp.detach() - old)[on].mean())
        assert torch.allclose(g[on], want[on] * s, rtol=1e-12) and not torch.allclose(s, torch.ones((), dtype=F64))


def test_every_loss_name_is_declared_once():
    """config.py's --loss list and loss.LOSSES name the same losses: what a loss needs is in its row."""
    import typing

    assert set(typing.get_args(typing.get_type_hints(Config)["loss"])) == set(L.LOSSES)


def test_the_docs_loss_table_names_every_loss_and_the_flags_it_reads():
    """docs/design.md's table of corrections is the docs' one loss table: each LOSSES entry has its
    `--loss NAME` there, in a row that shows every flag the loss reads; no other loss is named."""
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parent.parent / "docs" / "design.md").read_text()
    table = doc[doc.index("| correction | formula | floe flag |"):]
    rows = [r for r in table[:table.index("\n\n")].splitlines() if r.startswith("| ")]
    named = {m for r in rows for m in re.findall(r"--loss (\w+)", r)}
    assert named == set(L.LOSSES)
    for name, loss in L.LOSSES.items():
        row = next(r for r in rows if f"--loss {name}" in r)
        for flag in loss.reads:
            assert f"--{flag.replace('_', '-')}" in row, (name, flag)



class _OnDevice(torch.Tensor):
    """A CPU tensor that says it lives on an accelerator, with CUDA's rule that stack and cat take
    one device (no CPU-scalar exception there, unlike elementwise ops)."""

    @property
    def device(self):
        return torch.device("meta")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in (torch.stack, torch.cat) and len({isinstance(t, _OnDevice) for t in args[0]}) > 1:
            raise RuntimeError("Expected all tensors to be on the same device")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_reduce_metrics_takes_the_rollouts_host_stats_and_the_steps_device_metrics():
    """On CUDA a step's total mixes the rollout's stats (host tensors), the loss's metrics (device
    tensors) and the optimizer's grad_norm (a device sum over a host count); one reduction reads them."""
    dev = lambda x: torch.tensor(x, dtype=torch.float64).as_subclass(_OnDevice)  # noqa: E731
    host = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    total = {"reward/mean": (host(3.0), host(4.0)), "loss": (dev(1.5), dev(3.0)), "grad_norm": (dev(2.0), host(1.0)),
             "unused": (host(0.0), host(0.0))}
    accumulate(total, {"loss": (dev(0.5), dev(1.0)), "kl/k1": (dev(0.25), host(1.0))})
    assert reduce_metrics(total) == {"reward/mean": 0.75, "loss": 0.5, "grad_norm": 2.0, "kl/k1": 0.25}
