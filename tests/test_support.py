"""Sampler evidence from the built-in engine: K draws follow q (chi-square); the support travels
through packing intact (the kept set against a full forward: tests/test_engines.py)."""

import math

import numpy as np
import torch

import data as D

from tasks.textcodec import TextCodec
import data
from tasks import task as T
import model as M
from engines.sampling import draw
from engines.torch_engine import Sampling, TorchEngine


def _model():
    m = M.Transformer(M.ModelArgs(vocab_size=32, **M.TINY))
    M.init_weights(m, std=0.15, seed=0)
    return m


def test_untruncated_support_is_k_draws():
    model = _model()
    engine = TorchEngine(model, "fp32", [2], seed=0)
    out = engine.generate([[1, 5, 6]], 3, Sampling(max_new_tokens=6, support=True, draws=5))
    for c in out:
        assert not bool(c.support.replayed.any())
        assert np.all(np.diff(c.support.host_offsets) == 5)
        assert torch.equal(c.support.offsets, torch.from_numpy(c.support.host_offsets))


def test_draws_follow_q_chi_square():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 12, generator=g) * 1.5
    logits[0, 3] = -float("inf")  # a zero-probability token is never drawn
    logprobs = logits.log_softmax(-1)
    n = 40_000
    ids = draw(logprobs.expand(n // 8, 12).contiguous(), 8, g).flatten()
    counts = torch.bincount(ids, minlength=12).double()
    assert counts[3] == 0
    expected = logprobs.exp()[0].double() * n
    live = expected > 0
    chi2 = float((((counts - expected) ** 2)[live] / expected[live]).sum())
    dof = int(live.sum()) - 1
    # survival function of chi-square by the Wilson-Hilferty normal approximation
    zscore = ((chi2 / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    p_value = 0.5 * math.erfc(zscore / math.sqrt(2))
    assert p_value > 0.001, (chi2, dof, p_value)


def test_support_survives_packing():
    model = _model()
    engine = TorchEngine(model, "fp32", [2], seed=0)
    task = T.ReverseText(TextCodec.tiny(), eval_size=2)
    prompts = task.eval_set
    out = engine.generate([p.ids for p in prompts], 2, Sampling(top_p=0.9, max_new_tokens=8, support=True))
    samples = [D.Sample(prompts[i // 2], c.ids, c.logq, c.versions, c.finish_reason, c.support) for i, c in enumerate(out)]
    for mb in data.pack(samples, 128):
        sup = mb.support
        assert sup.num_rows == 128 and torch.equal(sup.offsets, torch.from_numpy(sup.host_offsets))
        for i in mb.samples:
            s = samples[i]
            at = ((mb.sample_idx == i) & mb.loss_mask).nonzero()[:, 0].tolist()  # its trained positions
            assert len(at) == len(s.completion)
            for t, pos in enumerate(at):
                a, b = int(sup.host_offsets[pos]), int(sup.host_offsets[pos + 1])
                e, f = int(s.support.host_offsets[t]), int(s.support.host_offsets[t + 1])
                assert sup.ids[a:b].tolist() == s.support.ids[e:f].tolist()
                assert mb.labels[pos] == s.completion[t]
        trained = mb.loss_mask.nonzero()[:, 0].tolist()
        empty = [t for t in range(128) if t not in trained]
        assert all(sup.host_offsets[t] == sup.host_offsets[t + 1] for t in empty)
