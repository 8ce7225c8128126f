"""The built-in engine's own dtype and seeding, and group advantages (the engine against a full
forward: tests/test_engines.py, the suite both engines pass)."""

import contextlib
import math
import unittest.mock

import pytest
import torch

import model as M

from run import hfdir
from loss import group_advantages
from engines.precision import Fp8Linear, fp8_quantize
from engines.kvcache import KVCache
from engines.torch_engine import Sampling, TorchEngine


def _model():
    m = M.Transformer(M.ModelArgs(vocab_size=32, **M.TINY))
    M.init_weights(m, std=0.15, seed=0)  # a peaked but not one-hot distribution
    return m


def test_engine_runs_in_its_own_dtype_and_takes_new_weights():
    model = _model()
    engine = TorchEngine(model, "bf16", [2], seed=0)
    for p in engine.model.parameters():  # on a CPU: fp32 arithmetic on bf16 values (precision.Rounded)
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
    """On a CPU the bf16/fp16 engine computes in fp32 on rounded values (precision.Rounded). Its
    mismatch against the fp32 trainer must stay below the native dtype's (it rounds fewer places)
    and at least a tenth of it: not zero (nothing was rounded), not larger (the wrong thing was)."""
    model = hfdir.load("checkpoints/reverse-tiny")
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
        cache = KVCache(model.args, 8, 40, next(e.model.parameters()).dtype, "cpu")
        with torch.no_grad():
            h = e.model.forward_cached(tokens, pos, cache)
            return e._logits(h.to(next(e.model.parameters()).dtype)).log_softmax(-1)

    ref = logp(TorchEngine(model, "fp32", [2], seed=0))
    emulated, real = _kl(ref, logp(engine)), _kl(ref, logp(native))
    assert real > 1e-7 and real / 10 < emulated < real, (emulated, real)


def _nearest_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest finite float8 e4m3 value, ties to the even code, by search in the
    table of its codes (an independent reference for the cast fp8_quantize uses)."""
    codes = torch.arange(127, dtype=torch.uint8)  # 0 .. 0x7e: +0 up to 448, in increasing order (0x7f: NaN)
    pos = codes.view(torch.float8_e4m3fn).float()
    table = torch.cat([-pos.flip(0)[:-1], pos])  # -448 .. -min, 0, min .. 448
    even = torch.cat([codes.flip(0)[:-1], codes]) % 2 == 0  # a negative value's code differs only in the sign bit
    i = torch.searchsorted(table, x.contiguous()).clamp(1, len(table) - 1)
    lo, hi = table[i - 1], table[i]
    up = (hi - x < x - lo) | ((hi - x == x - lo) & even[i])
    return torch.where(up, hi, lo)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_native_low_precision_engine_keeps_the_rope_frequencies_in_fp32(dtype):
    """On CUDA (and for an FSDP2 shard or the files) the engine's copy is built in its dtype
    (`_built`); RoPE's inverse frequencies must stay fp32, as the trainer's and vLLM's: rounded to
    bf16 they move a Qwen3 angle by over a radian at position 1000. The copy's cos/sin against the
    fp32 ones rounded once to its dtype, out to position 4000."""
    a = M.ModelArgs(vocab_size=32, **dict(M.TINY, head_dim=128, max_position_embeddings=4096))
    trainer = M.Transformer(a)
    own = TorchEngine._built(unittest.mock.Mock(device=torch.device("cpu")), trainer, dtype)
    assert own.inv_freq.dtype == torch.float32 and torch.equal(own.inv_freq, M.rope_frequencies(a))
    positions = torch.arange(0, 4000, 7)[None]
    for got, want in zip(own._rope(positions, dtype), trainer._rope(positions, torch.float32)):
        assert got.dtype == dtype
        assert (got.float() - want).abs().max() <= 2.0**-8  # one rounding of values in [-1, 1]


def test_fp8_quantize_rounds_each_row_to_e4m3_with_its_own_scale():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 48, generator=g) * torch.logspace(-3, 1, 64)[:, None]  # rows of very different sizes
    w[:, 0] = w[:, 0].bfloat16().float()  # bf16 inputs land exactly on e4m3 midpoints often: ties to even
    q, scale = fp8_quantize(w)
    assert scale.shape == (64, 1)
    torch.testing.assert_close(scale[:, 0], w.abs().amax(1) / 448)
    assert torch.equal(q.abs().amax(1), torch.full((64,), 448.0))  # every row's largest entry maps to 448
    assert torch.equal(q, _nearest_e4m3(w / scale))
    rel = ((q * scale - w).abs() / w.abs())[w.abs() > scale * 2**-6]  # e4m3's normal range
    assert rel.max() <= 2**-4 + 1e-6  # 3 mantissa bits: half an ulp is 1/16 relative


def test_fp8_linear_is_a_w8a8_matmul_with_bf16_outputs():
    """Fp8Linear against the dequantize-first form in float64 (each input row and weight row on its
    own scale, the products summed, the bias added, the output rounded once to bf16), and its
    weight pushes requantize."""
    g = torch.Generator().manual_seed(1)
    linear = torch.nn.Linear(48, 40, bias=True)
    f = Fp8Linear(linear, emulated=True)
    x = torch.randn(7, 48, generator=g) * torch.logspace(-2, 2, 7)[:, None]
    for _ in range(2):  # a second push: new weights, new scales
        master = torch.randn(40, 48, generator=g) * 0.1
        f.quantize(master)
        xq, sx = fp8_quantize(x.bfloat16())
        wq, sw = fp8_quantize(master)
        ref = ((xq * sx).double() @ (wq * sw).double().T + linear.bias.double()).bfloat16().float()
        out = f(x)
        assert out.dtype == torch.float32 and torch.equal(out, out.bfloat16().float())
        assert (out != ref).float().mean() < 0.01  # where the fp32 sum falls on the other side of a bf16 rounding
        torch.testing.assert_close(out, ref, rtol=2**-7, atol=0)


def test_fp8_engine_mismatch_is_larger_than_bf16s():
    """On the shipped model's own text the fp8 engine (W8A8, the head included) is farther from the
    fp32 trainer than the bf16 engine is, and still a close copy of it."""
    model = hfdir.load("checkpoints/reverse-tiny")
    prompts = [[1, 23, 21, 7, 20, 31, 20, 7, 24, 7, 20, 21, 7, 30, 29, 5, 3, 22, 29, 6, 17, 9, 2, 31]]
    out = TorchEngine(model, "fp32", [2], seed=0).generate(prompts, 8, Sampling(max_new_tokens=16))
    tokens = torch.tensor([(prompts[0] + c.ids + [0] * 16)[:40] for c in out])
    pos = torch.arange(40).expand(8, 40)

    def logp(dtype):
        e = TorchEngine(model, dtype, [2], seed=0)
        cache = KVCache(model.args, 8, 40, torch.float32, "cpu")
        with torch.no_grad():
            return e._logits(e.model.forward_cached(tokens, pos, cache)).log_softmax(-1)

    ref = logp("fp32")
    bf16, fp8 = _kl(ref, logp("bf16")), _kl(ref, logp("fp8"))
    assert 5 * bf16 < fp8 < 1e-2, (bf16, fp8)


def test_engine_noise_is_a_seeded_mismatch_that_grows_with_its_size():
    """--engine-noise (Sampling.noise): the engine samples from, and reports, logits + N(0, s^2).
    0 leaves the engine's draws as they were; the reported logq leaves the trainer's log p by more
    as s grows; a fixed seed repeats the noise."""
    model, prompts = _model(), [[5, 6, 7], [8, 9]]
    engine = TorchEngine(model, "fp32", [2])
    gaps = []
    for noise in (0.0, 0.3, 1.0):
        out = engine.generate(prompts, 4, Sampling(max_new_tokens=10, seed=4, noise=noise))
        again = engine.generate(prompts, 4, Sampling(max_new_tokens=10, seed=4, noise=noise))
        assert [c.logq for c in out] == [c.logq for c in again]
        gap = []
        for i, c in enumerate(out):
            ids = torch.tensor(prompts[i // 4] + c.ids)
            with torch.no_grad():
                h = model(ids, torch.arange(len(ids)), torch.zeros(len(ids), dtype=torch.long))
                logp = (h @ model.head_weight.T).log_softmax(-1)[len(prompts[i // 4]) - 1: -1]
            gap += [abs(lq - logp[t, v].item()) for t, (v, lq) in enumerate(zip(c.ids, c.logq))]
        gaps.append(sum(gap) / len(gap))
    assert gaps[0] < 1e-5 < 0.05 < gaps[1] < gaps[2], gaps


def test_sampling_is_seeded():
    model = _model()
    a = TorchEngine(model, "fp32", [2], seed=3).generate([[5, 6]], 4, Sampling(max_new_tokens=8))
    b = TorchEngine(model, "fp32", [2], seed=3).generate([[5, 6]], 4, Sampling(max_new_tokens=8))
    assert [c.ids for c in a] == [c.ids for c in b]


@pytest.mark.parametrize("top_k", [0, 5])  # K draws per token; the kept set of a truncated sampler
def test_generate_is_the_same_under_no_grad_and_leaves_no_inference_tensors_to_the_trainer(top_k):
    """The decode runs under inference mode (no autograd bookkeeping per operator): the same draws
    and log-probs as a plain no_grad run of the same code, and what the trainer receives (the
    support's tensors) are ordinary tensors that autograd may save."""
    model = _model()
    s = Sampling(max_new_tokens=6, seed=5, support=True, top_k=top_k)
    prompts = [[5, 6, 7], [8, 9]]
    fast = TorchEngine(model, "bf16", [2], seed=0).generate(prompts, 3, s)
    with torch.no_grad(), unittest.mock.patch.object(torch, "inference_mode", contextlib.nullcontext):
        plain = TorchEngine(model, "bf16", [2], seed=0).generate(prompts, 3, s)
    for a, b in zip(fast, plain):
        assert (a.ids, a.logq) == (b.ids, b.logq)
        assert torch.equal(a.support.ids, b.support.ids) and torch.equal(a.support.logq, b.support.logq)
        assert not a.support.ids.is_inference() and not a.support.logq.is_inference()
        w = torch.ones(len(a.support.logq), requires_grad=True)
        (w * a.support.logq.float()).sum().backward()  # saves the support's tensor for the backward
        assert torch.equal(w.grad, a.support.logq.float())


def test_group_advantages():
    adv = group_advantages([1.0, 0.0, 0.5, 0.5, 0.2, 0.2], group_size=2)
    assert adv == pytest.approx([0.5, -0.5, 0.0, 0.0, 0.0, 0.0])
    adv = group_advantages([1.0, 0.0, 3.0, 1.0], group_size=2, std_norm=True)
    assert adv == pytest.approx([1.0, -1.0, 1.0, -1.0], abs=1e-5)


def test_an_import_from_the_engines_old_home_fails():
    """rollout.py now means the rollout phase; the engine contract lives in engines/torch_engine.py, and an old
    `from rollout import TorchEngine` must fail, never find something else under that name."""
    import rollout

    for name in ("TorchEngine", "Engine", "Completion", "SupportRecorder", "truncate", "draw"):
        with pytest.raises(ImportError):
            exec(f"from rollout import {name}", {})
    assert rollout.Sampling is Sampling  # the phase builds its Sampling from the contract's class
