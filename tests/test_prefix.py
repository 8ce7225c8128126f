"""The built-in engine's kept cache rows (engines/torch_engine.py): a call whose prompts extend the last call's
rows (a multi-turn episode's next turn) prefills only the new tokens, and every logq and support
row it reports is still the full fp32 forward's of the whole sequence. Rows are dropped when the
weights change and on idle(); rows that left the decode batch early are kept too."""

import dataclasses
import math

import pytest
import torch

import model as M
from engines import torch_engine
import train
from engines.torch_engine import Sampling, TorchEngine

STOPS = [2, 0]
PROMPTS = [[1, 5, 6, 7, 8], [1, 9, 10, 11]]
REPLY = [3, 12, 13]  # an environment's reply: ids the model did not sample


def _model(seed=0):
    m = M.Transformer(M.ModelArgs(vocab_size=32, **M.TINY))
    M.init_weights(m, std=0.15, seed=seed)  # a peaked but not one-hot distribution
    return m


def _engine(model, reuse=True, syncs=True, seed=3):
    e = TorchEngine(model, "fp32", STOPS, seed=seed)
    e.reuse, e.syncs = reuse, syncs  # syncs False: the GPU's decode loop (no row leaves the batch)
    prefills = []  # the token shape of every forward; cleared before a call, [0] is its prefill
    forward = e.model.forward_cached
    e.model.forward_cached = lambda tok, pos, cache: prefills.append(tuple(tok.shape)) or forward(tok, pos, cache)
    return e, prefills


def _check(model, prompt, c, s: Sampling):
    """c's logq, and its support rows when reported, against a full fp32 forward of prompt + c.ids."""
    ids = torch.tensor(prompt + c.ids)
    with torch.no_grad():
        h = model(ids, torch.arange(len(ids)), torch.zeros(len(ids), dtype=torch.long))
        z = (h @ model.head_weight.T).double()[len(prompt) - 1: -1] / s.temperature
    if s.top_k:
        z = z.masked_fill(z < z.topk(s.top_k, -1).values[:, -1:], -math.inf)
    ref = z.log_softmax(-1)
    for t, (tok, lq) in enumerate(zip(c.ids, c.logq)):
        assert abs(lq - ref[t, tok].item()) < 1e-5, (t, lq, ref[t, tok].item())
        if c.support is not None:
            a, b = int(c.support.host_offsets[t]), int(c.support.host_offsets[t + 1])
            got = dict(zip(c.support.ids[a:b].tolist(), c.support.logq[a:b].tolist()))
            assert set(got) == set(torch.isfinite(ref[t]).nonzero()[:, 0].tolist())
            assert all(abs(q - ref[t, v].item()) < 2e-5 for v, q in got.items())


def _continue(prompts, n, out):
    """Each output row's whole sequence and a reply: the next turn's prompts."""
    return [prompts[b // n] + c.ids + REPLY for b, c in enumerate(out)]


S = Sampling(temperature=0.9, top_k=6, max_new_tokens=8, support=True)


@pytest.mark.parametrize("reuse,syncs", [(True, True), (True, False), (False, True)],
                         ids=["kept", "kept-gpu-loop", "re-prefilled"])
def test_a_continued_call_equals_a_full_forward_kept_or_not(reuse, syncs):
    model = _model()
    engine, prefills = _engine(model, reuse, syncs)
    out = engine.generate(PROMPTS, 3, S)
    prompts = _continue(PROMPTS, 3, out)
    for _ in range(2):  # two continued turns: the second extends rows the first one kept
        prefills.clear()
        out = engine.generate(prompts, 1, S)
        # kept: each prompt's reply and the last sampled token (never fed); else the whole prompt
        assert prefills[0] == (len(prompts), len(REPLY) + 1 if reuse else max(map(len, prompts))), prefills
        for p, c in zip(prompts, out):
            _check(model, p, c, S)
        prompts = _continue(prompts, 1, out)


def test_rows_that_finished_early_are_kept_and_n_above_one_continues_them():
    """Rows leave the decode batch at many different steps; each is continued (n = 2) from all of
    its own cached slots, and every continued row is its full forward's."""
    model = _model()
    engine, prefills = _engine(model)
    s = dataclasses.replace(S, temperature=1.2, max_new_tokens=16)
    sizes, step = [], engine.step
    engine.step = lambda tok, pos, cache: sizes.append(len(tok)) or step(tok, pos, cache)
    out = engine.generate(PROMPTS, 8, s)
    assert len(set(sizes)) >= 3 and len({len(c.ids) for c in out}) > 3, sizes  # left at many steps
    prompts = _continue(PROMPTS, 8, out)
    prefills.clear()
    again = engine.generate(prompts, 2, s)
    assert prefills[0] == (16, len(REPLY) + 1)  # every prompt: its reply and the last sampled token
    for i, c in enumerate(again):
        _check(model, prompts[i // 2], c, s)


def test_new_weights_and_idle_drop_the_kept_rows():
    """After load_weights the kept keys are the old weights' (a continuation that used them would
    not be the new model's forward); after idle() nothing is kept."""
    model, other = _model(0), _model(1)
    engine, prefills = _engine(model)
    prompts = _continue(PROMPTS, 2, engine.generate(PROMPTS, 2, S))
    engine.load_weights(other, version=1)
    prefills.clear()
    out = engine.generate(prompts, 1, S)
    assert prefills[0] == (4, max(map(len, prompts)))
    for p, c in zip(prompts, out):
        _check(other, p, c, S)
    engine.idle()
    assert engine.kept is None
    prefills.clear()
    engine.generate([p + c.ids + REPLY for p, c in zip(prompts, out)], 1, S)
    assert prefills[0][1] > len(REPLY) + 1


def test_prompts_that_extend_nothing_prefill_whole_beside_those_that_do():
    """One call, mixed: continued prompts, a fresh one, and one that diverges from its row inside
    the cached part (no match: a kept row is reused only for an exact start)."""
    model = _model()
    engine, prefills = _engine(model)
    first = engine.generate(PROMPTS, 1, S)
    diverged = list(PROMPTS[1][:2]) + [14] + PROMPTS[1][3:] + first[1].ids + REPLY
    prompts = [PROMPTS[0] + first[0].ids + REPLY, [1, 20, 21, 22, 23, 24, 25], diverged]
    prefills.clear()
    out = engine.generate(prompts, 2, S)
    assert prefills[0] == (3, max(7, len(diverged)))
    for i, c in enumerate(out):
        _check(model, prompts[i // 2], c, S)
    assert engine.kept.match(prompts[0] + out[0].ids + REPLY) == (0, len(prompts[0]) + len(out[0].ids) - 1)
    assert engine.kept.match(prompts[0])[1] == 0  # a prompt no longer than a row's valid part: nothing to gain


def test_a_single_turn_job_never_reuses():
    """Calls whose prompts do not extend the last call's rows (every single-turn step) prefill
    their whole prompts, and draw exactly what an engine that keeps nothing draws."""
    a, pa = _engine(_model())
    b, _ = _engine(_model(), reuse=False)
    for _ in range(3):
        pa.clear()
        x, y = a.generate(PROMPTS, 4, S), b.generate(PROMPTS, 4, S)
        assert pa[0] == (2, 5)
        assert [c.ids for c in x] == [c.ids for c in y] and [c.logq for c in x] == [c.logq for c in y]


def test_a_bf16_engine_continues_as_close_to_the_fp32_forward_as_it_re_prefills():
    """The default engine dtype: kept keys were computed by bf16 decode steps, re-prefilled ones by
    a bf16 prefill, so the two differ only by rounding. Each one's |logq - fp32 log p| over a
    continued call, mean over its tokens, must agree within 1.5x and be nonzero (bf16 rounded)."""
    model = _model()
    s = Sampling(temperature=1.0, max_new_tokens=8, seed=5)
    gaps = []
    for reuse in (True, False):
        engine = TorchEngine(model, "bf16", STOPS, seed=3)
        engine.reuse = reuse
        prompts = _continue(PROMPTS, 4, engine.generate(PROMPTS, 4, s))
        out = engine.generate(prompts, 1, s)
        gap = []
        for p, c in zip(prompts, out):
            ids = torch.tensor(p + c.ids)
            with torch.no_grad():
                h = model(ids, torch.arange(len(ids)), torch.zeros(len(ids), dtype=torch.long))
                ref = (h @ model.head_weight.T).double()[len(p) - 1: -1].log_softmax(-1)
            gap += [abs(lq - ref[t, v].item()) for t, (v, lq) in enumerate(zip(c.ids, c.logq))]
        gaps.append(sum(gap) / len(gap))
    kept, again = gaps
    assert again > 1e-5 and again / 1.5 < kept < again * 1.5, gaps


def test_a_single_turn_call_keeps_no_rows_and_an_episodes_next_turn_still_reuses_them():
    """keep=False (what a single-turn rollout and an eval pass) keeps nothing: the next call
    prefills its whole prompts. keep=True (the default, and an episode's turn) keeps the rows: the
    next turn prefills only its new tokens. The draws are the same either way, and the same as an
    engine that never keeps."""
    model = _model()
    (a, pa), (b, pb), (c, _) = _engine(model), _engine(model), _engine(model, reuse=False)
    x, y, z = a.generate(PROMPTS, 4, S, keep=False), b.generate(PROMPTS, 4, S), c.generate(PROMPTS, 4, S)
    assert a.kept is None and b.kept is not None
    assert [o.ids for o in x] == [o.ids for o in y] == [o.ids for o in z]
    assert [o.logq for o in x] == [o.logq for o in y] == [o.logq for o in z]
    prompts = _continue(PROMPTS, 4, x)
    pa.clear(), pb.clear()
    x2, y2 = a.generate(prompts, 1, S, keep=False), b.generate(prompts, 1, S, keep=True)
    assert pa[0] == (len(prompts), max(map(len, prompts)))  # whole prompts: nothing was kept
    assert pb[0] == (len(prompts), len(REPLY) + 1)  # only the reply and the last sampled token
    assert a.kept is None and b.kept is not None
    assert [o.ids for o in x2] == [o.ids for o in y2]
    for p, o in zip(prompts, y2):
        _check(model, p, o, S)


def test_a_single_turn_job_passes_keep_false_and_an_episode_job_keeps_until_its_last_turn(tmp_path, monkeypatch):
    """The callers say it: train's rollout and eval never ask the engine to keep rows; the episode
    loop asks on every turn that another turn may follow (--max-turns)."""
    calls = []
    generate = torch_engine.TorchEngine.generate

    def recording(self, prompts, n, sampling, budgets=None, keep=True):
        out = generate(self, prompts, n, sampling, budgets, keep)
        calls.append((keep, self.kept is not None))
        return out
    monkeypatch.setattr(torch_engine.TorchEngine, "generate", recording)
    train.main(["--steps", "1", "--prompts-per-step", "2", "--group-size", "2", "--eval-prompts", "4",
                "--out-dir", str(tmp_path / "one")])
    assert len(calls) == 3 and calls == [(False, False)] * 3  # eval at 0, the step, eval at the end
    calls.clear()
    train.main(["--task", "jsonl:examples/guess.jsonl", "--env", "guess-letter", "--model", "checkpoints/guess-tiny",
                "--max-new-tokens", "4", "--max-turns", "3", "--steps", "1", "--prompts-per-step", "2",
                "--group-size", "2", "--eval-every", "0", "--out-dir", str(tmp_path / "episodes")])
    assert [k for k, _ in calls] == [True, True, False][: len(calls)] and len(calls) >= 2, calls
    assert all(kept == keep for keep, kept in calls), calls
