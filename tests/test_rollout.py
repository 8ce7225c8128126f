"""The built-in engine against a full forward of the trainer model, and group advantages."""

import math

import pytest
import torch

import data as D
import model as M
from rollout import Sampling, TorchEngine, group_advantages


def _model():
    m = M.Qwen3(M.ModelArgs(vocab_size=32, **M.TINY))
    M.init_weights(m, std=0.15, seed=0)  # a peaked but not one-hot distribution
    return m


def _kept(probs: list[float], top_k: int, top_p: float) -> set[int]:
    """Independent top-k then top-p, by sorting in plain python (vLLM's order)."""
    order = sorted(range(len(probs)), key=lambda v: -probs[v])
    if top_k:
        order = order[:top_k]
    if top_p < 1:
        z = sum(probs[v] for v in order)
        kept, mass = [], 0.0
        for v in order:
            kept.append(v)
            mass += probs[v] / z
            if mass >= top_p:
                break
        order = kept
    return set(order)


@pytest.mark.parametrize("sampling", [Sampling(temperature=0.7), Sampling(top_p=0.8), Sampling(temperature=1.3, top_k=5),
                                      Sampling(top_k=8, top_p=0.7)], ids=["plain", "top_p", "top_k", "top_k_top_p"])
def test_engine_logq_equals_full_forward(sampling):
    model = _model()
    codec = D.TextCodec(D.char_tokenizer(), [2])
    engine = TorchEngine(model, "fp32", codec.stop_ids, seed=0)
    prompts = [codec.encode("<|im_start|>user\nreverse: abc<|im_end|>\n"), codec.encode("hello world")]
    sampling.max_new_tokens = 12
    out = engine.generate(prompts, 3, sampling)
    assert len(out) == 6
    checked = 0
    for i, c in enumerate(out):
        ids = torch.tensor(prompts[i // 3] + c.ids)
        with torch.no_grad():
            h = model(ids, torch.arange(len(ids)), torch.zeros(len(ids), dtype=torch.long))
            probs = ((h @ model.head_weight.T) / sampling.temperature).softmax(-1).double()
        P = len(prompts[i // 3])
        for t, (tok, logq) in enumerate(zip(c.ids, c.logq)):
            row = probs[P - 1 + t].tolist()
            kept = _kept(row, sampling.top_k, sampling.top_p)
            assert tok in kept
            ref = math.log(row[tok] / sum(row[v] for v in kept))
            assert abs(logq - ref) < 1e-5, (t, logq, ref)
            checked += 1
        assert c.versions == [0] * len(c.ids)
        assert (c.finish_reason == "stop") == (c.ids[-1] in codec.stop_ids)
    assert checked > 20


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
