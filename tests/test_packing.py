"""Shared-prompt packing (data.pack): one copy of a group's prompt per buffer, the same numbers as
one copy per sample; the unshared layout with the dense mask is the reference."""

import functools

import pytest
import torch

import config as C
from layers.masks import reduce_metrics
import model as M
import data
import train
from test_train import _samples, _setup

PACK = data.pack


def _cfg(**kw):
    return C.Config(loss="icepop", icepop_alpha=0.8, icepop_beta=1.25, prompts_per_step=4, group_size=4,
                    max_new_tokens=10, micro_batch_tokens=256, **kw)


def _step(monkeypatch, cfg, m, samples, share: bool, attention: str, device: str = "cpu"):
    """Per-sample completion log-probs, the metrics and every gradient of one RL step. Unshared:
    every buffer [T]; shared: the buffers train.prepare asks for (trimmed on an eager CPU)."""
    trimmed = functools.partial(PACK, share_prompts=True)
    monkeypatch.setattr(train, "pack", trimmed if share else lambda s, T, trim: PACK(s, T, share_prompts=False))
    model = M.Transformer(m.args)
    model.attention = attention
    model.load_state_dict(m.state_dict())
    model.to(device)
    mbs, denom, _ = train.prepare(cfg, samples, 32, device)
    logp = {}
    with torch.no_grad():
        for mb in mbs:
            lp = train._head(cfg, model, model, mb)[0]
            for i in mb.samples:
                logp[i] = lp[(mb.sample_idx == i) & mb.loss_mask]
    metrics = reduce_metrics(train.backward_pass(cfg, model, model, mbs, denom, step=0))
    return mbs, {i: lp.cpu() for i, lp in logp.items()}, metrics, [p.grad.cpu() for p in model.parameters()]


def _against_unshared(monkeypatch, agg: str, paths: list[tuple[str, str]]):
    """The shared layout on each (attention, device) path against the unshared dense CPU step."""
    codec, m, task = _setup()
    cfg = _cfg(loss_agg=agg)
    samples = _samples(cfg, m, codec, task)
    ref_mbs, ref_logp, ref_m, ref_g = _step(monkeypatch, cfg, m, samples, share=False, attention="dense")
    for attention, device in paths:
        mbs, logp, metrics, grads = _step(monkeypatch, cfg, m, samples, True, attention, device)
        assert sum(int(mb.parents.ge(0).any()) for mb in mbs) == len(mbs)  # every buffer shares a prompt
        assert len(mbs) < len(ref_mbs) and {len(mb.tokens) for mb in ref_mbs} == {cfg.micro_batch_tokens}
        lengths = [len(mb.tokens) for mb in mbs]
        if device == "cpu":  # eager: each buffer cut to a multiple of 64 past its last document
            used = [int(mb.sample_idx.ge(0).nonzero()[-1]) + 1 for mb in mbs]  # a buffer ends on a completion
            assert all(n % 64 == 0 and 0 <= n - u < 64 for n, u in zip(lengths, used)), (lengths, used)
            assert min(lengths) < cfg.micro_batch_tokens, lengths
        else:
            assert set(lengths) == {cfg.micro_batch_tokens}
        assert logp.keys() == ref_logp.keys() == set(range(len(samples)))
        for i in logp:
            assert len(logp[i]) == len(samples[i].completion)
            torch.testing.assert_close(logp[i], ref_logp[i], atol=1e-5, rtol=0)
        assert 0.02 < ref_m["icepop/masked_fraction"] < 0.9 and metrics.keys() == ref_m.keys()
        for k in metrics:
            assert metrics[k] == pytest.approx(ref_m[k], abs=1e-5, rel=1e-5), k
        for a, b in zip(grads, ref_g):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("agg", ["token", "sequence"])
def test_shared_prompts_give_the_unshared_step(monkeypatch, agg):
    _against_unshared(monkeypatch, agg, [("dense", "cpu"), ("rows", "cpu")])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_shared_prompts_on_the_cuda_flex_path_give_the_unshared_step(monkeypatch):
    torch.backends.cuda.matmul.allow_tf32 = False
    _against_unshared(monkeypatch, "token", [("auto", "cuda")])  # flex attention, the Triton head


def test_shared_layout_holds_each_prompt_once_and_every_completion():
    codec, m, task = _setup()
    cfg = _cfg()
    samples = _samples(cfg, m, codec, task)
    (mb,) = data.pack(samples, 512)
    prompts = {tuple(s.prompt.ids) for s in samples}
    used = sum(len(p) - 1 for p in prompts) + sum(len(s.completion) for s in samples)
    assert used < sum(len(s.ids) - 1 for s in samples) / 2  # the unshared layout's tokens
    pad = torch.arange(512) >= used
    assert bool((mb.positions[pad] == 0).all() and (mb.sample_idx[pad] == -1).all() and (mb.parents[pad] == -1).all())
    assert len(set(mb.doc_ids[pad].tolist())) == 512 - used  # one-token documents, never trained
    for i, s in enumerate(samples):
        at = (mb.sample_idx == i).nonzero()[:, 0]
        assert mb.tokens[at].tolist() == [s.prompt.ids[-1]] + s.completion[:-1]
        assert mb.labels[at].tolist() == s.completion and bool(mb.loss_mask[at].all())
        assert mb.positions[at].tolist() == list(range(len(s.prompt.ids) - 1, len(s.ids) - 1))
        parent = mb.parents[at]
        assert bool((parent == parent[0]).all())
        shared = (mb.doc_ids == parent[0]).nonzero()[:, 0]  # the prompt's one copy
        assert mb.tokens[shared].tolist() == s.prompt.ids[:-1]


def test_a_group_larger_than_a_buffer_is_split_with_its_own_prompt_copies():
    codec, m, task = _setup()
    cfg = _cfg()
    every = _samples(cfg, m, codec, task)
    samples = [s for s in every if s.prompt.ids == every[0].prompt.ids]  # one group
    P = len(samples[0].prompt.ids)
    T = P - 1 + len(samples[0].completion) + len(samples[1].completion)  # two completions per buffer at most
    T = max(T, max(len(s.ids) - 1 for s in samples))
    mbs = data.pack(samples, T)
    assert len(mbs) >= 2
    assert sorted(i for mb in mbs for i in mb.samples) == list(range(len(samples)))
    for mb in mbs:
        assert mb.num_loss_tokens == sum(len(samples[i].completion) for i in mb.samples)
