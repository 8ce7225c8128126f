"""The built-in engine's own dtype and seeding, and group advantages (the engine against a full
forward: tests/test_engines.py, the suite both engines pass)."""

import math

import pytest
import torch

import model as M
from loss import group_advantages
from rollout import Sampling, TorchEngine


def _model():
    m = M.Transformer(M.ModelArgs(vocab_size=32, **M.TINY))
    M.init_weights(m, std=0.15, seed=0)  # a peaked but not one-hot distribution
    return m


def test_engine_runs_in_its_own_dtype_and_takes_new_weights():
    model = _model()
    engine = TorchEngine(model, "bf16", [2], seed=0)
    for p in engine.model.parameters():  # on a CPU: fp32 arithmetic on bf16 values (rollout.Rounded)
        assert torch.equal(p, p.bfloat16().float())
    with torch.no_grad():
        model.model.embed_tokens.weight.zero_()  # tied head: a zero head gives uniform logq
    engine.load_weights(model, version=7)
    out = engine.generate([[5, 6, 7]], 4, Sampling(max_new_tokens=5))
    for c in out:
        assert c.versions == [7] * len(c.ids)
        assert all(abs(lq + math.log(32)) < 1e-6 for lq in c.logq)


def _kl(ref: torch.Tensor, other: torch.Tensor) -> float:
    return (ref.exp() * (ref - other)).sum(-1).mean().item()


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_emulated_low_precision_mismatches_like_the_native_dtype(dtype):
    """On a CPU the bf16/fp16 engine computes in fp32 on rounded values (rollout.Rounded). Its
    mismatch against the fp32 trainer must stay below the native dtype's (it rounds fewer places:
    measured about 1/4 of it on this model's own text) and within 10x of it: not zero (nothing
    was rounded), not larger (the wrong thing was)."""
    model = M.load("checkpoints/reverse-tiny")
    engine = TorchEngine(model, dtype, [2], seed=0)
    assert engine.emulated
    native = TorchEngine(model, "fp32", [2], seed=0)
    native.model.to(engine.dtype)  # the native low-precision forward, slow on a CPU
    prompts = [[1, 23, 21, 7, 20, 31, 20, 7, 24, 7, 20, 21, 7, 30, 29, 5, 3, 22, 29, 6, 17, 9, 2, 31, 1, 3, 21, 21,
                11, 21, 22, 3, 16, 22, 31]]  # a chat prompt: "reverse: cat dog" (tokens 1..2: user turn)
    out = TorchEngine(model, "fp32", [2], seed=0).generate(prompts, 8, Sampling(max_new_tokens=20))
    tokens = torch.tensor([(prompts[0] + c.ids + [0] * 20)[:40] for c in out])  # the model's own text
    pos = torch.arange(40).expand(8, 40)

    def logp(e):
        cache = M.KVCache(model.args, 8, 40, next(e.model.parameters()).dtype, "cpu")
        with torch.no_grad():
            h = e.model.forward_cached(tokens, pos, cache)
            return e._logits(h.to(next(e.model.parameters()).dtype)).log_softmax(-1)

    ref = logp(TorchEngine(model, "fp32", [2], seed=0))
    emulated, real = _kl(ref, logp(engine)), _kl(ref, logp(native))
    assert real > 1e-7 and real / 10 < emulated < real, (emulated, real)


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
