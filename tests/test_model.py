"""model.py against transformers' Qwen3 (the reference), and packing against running each
document alone."""

import json
import random

import pytest
import torch

import data as D
import model as M

transformers = pytest.importorskip("transformers")


def _hf_checkpoint(tmp_path, tie: bool):
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=48, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   tie_word_embeddings=tie, max_position_embeddings=256, rope_theta=10000.0)
    hf = transformers.Qwen3ForCausalLM(cfg).float().eval()
    with torch.no_grad():  # HF's init has all-ones norms; random ones make the check sharper
        for name, p in hf.named_parameters():
            p.copy_(torch.randn_like(p) * (0.2 if "norm" in name else 0.05) + ("norm" in name))
    hf.save_pretrained(tmp_path)
    D.write_tokenizer(tmp_path)
    return hf


@pytest.mark.parametrize("tie", [True, False])
def test_logits_match_transformers(tmp_path, tie):
    hf = _hf_checkpoint(tmp_path, tie)
    ours = M.load(tmp_path)
    ids = torch.randint(0, 48, (1, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits[0]
        hidden = ours(ids[0], torch.arange(37), torch.zeros(37, dtype=torch.long))
        logits = hidden @ ours.head_weight.T
    assert ref.abs().max() > 1.0  # the comparison is not between two near-zero tensors
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)


def test_our_checkpoint_loads_in_transformers(tmp_path):
    a = M.ModelArgs(vocab_size=32, **M.TINY)
    ours = M.Qwen3(a)
    M.init_weights(ours, std=0.05, seed=3)
    (tmp_path / "tok").mkdir()
    D.write_tokenizer(tmp_path / "tok")
    M.save(ours, tmp_path / "ckpt", tmp_path / "tok")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float32).eval()
    ids = torch.randint(0, 32, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = hf(ids).logits[0]
        logits = ours(ids[0], torch.arange(20), torch.zeros(20, dtype=torch.long)) @ ours.head_weight.T
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)
    assert not (tmp_path / "ckpt.tmp").exists()


def test_save_replaces_an_existing_checkpoint(tmp_path):
    ours = M.Qwen3(M.ModelArgs(vocab_size=32, **M.TINY))
    M.init_weights(ours, seed=0)
    D.write_tokenizer(tmp_path)
    M.save(ours, tmp_path / "ckpt", tmp_path)
    M.init_weights(ours, seed=1)
    M.save(ours, tmp_path / "ckpt", tmp_path)
    again = M.load(tmp_path / "ckpt")
    torch.testing.assert_close(again.head_weight, ours.head_weight)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "tokenizer.json", "tokenizer_config.json"]


def test_config_mismatch_is_one_clear_error(tmp_path):
    _hf_checkpoint(tmp_path, tie=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["hidden_size"] = 32
    cfg["head_dim"] = 8
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="shape"):
        M.load(tmp_path)


def _samples(codec, n, seed):
    rng = random.Random(seed)
    task = D.ReverseText(codec, eval_size=4)
    out = []
    for p in task.sample(n, rng):
        comp = [rng.randrange(3, 32) for _ in range(rng.randint(1, 9))]
        out.append(D.Sample(p, comp, [-1.0] * len(comp), [0] * len(comp), "length", advantage=rng.random()))
    return out


def test_packing_keeps_every_token_and_attention_stays_in_its_document():
    torch.manual_seed(0)
    codec = D.TextCodec(D.char_tokenizer(), [2])
    ours = M.Qwen3(M.ModelArgs(vocab_size=32, **M.TINY))
    M.init_weights(ours, std=0.1, seed=0)
    samples = _samples(codec, 9, seed=4)
    mbs = D.pack(samples, 256)
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
