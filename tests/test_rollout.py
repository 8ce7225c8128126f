"""The built-in engine's own dtype and seeding, and group advantages (the engine against a full
forward: tests/test_engines.py, the suite both engines pass)."""

import math

import pytest
import torch

import model as M
from rollout import Sampling, TorchEngine, group_advantages


def _model():
    m = M.Transformer(M.ModelArgs(vocab_size=32, **M.TINY))
    M.init_weights(m, std=0.15, seed=0)  # a peaked but not one-hot distribution
    return m


def test_engine_runs_in_its_own_dtype_and_takes_new_weights():
    model = _model()
    engine = TorchEngine(model, "bf16", [2], seed=0)
    assert next(engine.model.parameters()).dtype == torch.bfloat16
    with torch.no_grad():
        model.model.embed_tokens.weight.zero_()  # tied head: a zero head gives uniform logq
    engine.load_weights(model, version=7)
    out = engine.generate([[5, 6, 7]], 4, Sampling(max_new_tokens=5))
    for c in out:
        assert c.versions == [7] * len(c.ids)
        assert all(abs(lq + math.log(32)) < 1e-6 for lq in c.logq)


def test_sampling_is_seeded():
    model = _model()
    a = TorchEngine(model, "fp32", [2], seed=3).generate([[5, 6]], 4, Sampling(max_new_tokens=8))
    b = TorchEngine(model, "fp32", [2], seed=3).generate([[5, 6]], 4, Sampling(max_new_tokens=8))
    assert [c.ids for c in a] == [c.ids for c in b]


def test_group_advantages():
    adv = group_advantages([1.0, 0.0, 0.5, 0.5, 0.2, 0.2], group_size=2)
    assert adv == pytest.approx([0.5, -0.5, 0.0, 0.0, 0.0, 0.0])
    adv = group_advantages([1.0, 0.0, 3.0, 1.0], group_size=2, std_norm=True)
    assert adv == pytest.approx([1.0, -1.0, 1.0, -1.0], abs=1e-5)
