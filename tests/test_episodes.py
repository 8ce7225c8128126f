"""Multi-turn episodes (agents/episodes.py): the token rule on three template families, exactness against
a full forward and a dense unpacked step, and the environment's faults.

The Qwen3- and Llama-3.1-behaving templates below are written here from those formats' public
descriptions (ChatML turns with a "\\n" after <|im_end|>, earlier turns' <think> blocks dropped,
tool results as <tool_response> blocks of a user turn, an empty think block when thinking is off;
Llama 3.1's header tokens, a system header with a knowledge date, <|eot_id|> ending every turn,
tool results as `ipython` turns whose string content goes through `tojson`, so `seven` is rendered
`"seven"`, as the real template does: Jinja treats a string as iterable), not copied from either
project.
"""

import json
import math
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

import config as C
import data as D
from tasks.textcodec import CHATML, LETTERS, TextCodec
from agents import envs
from agents import episodes as E
from layers.masks import reduce_metrics
import model as M
import rollout
import train
from conftest import one_line
from engines.torch_engine import Completion, Sampling, TorchEngine

ROOT = Path(__file__).resolve().parent.parent
CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 :\n<>/|_" + '"{}[],.ABCDEFGHIJKLMNOPQRSTUVWXYZ'  # JSON, schemas

QWEN3_LIKE = r"""
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- for m in messages -%}
  {%- if m.role == 'assistant' -%}
    {%- set text = m.content -%}
    {%- if loop.index0 < ns.last_user and '</think>' in text -%}{%- set text = text.split('</think>')[-1].lstrip('\n') -%}{%- endif -%}
    {{- '<|im_start|>assistant\n' + text + '<|im_end|>\n' -}}
  {%- elif m.role == 'tool' -%}
    {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
    {{- '\n<tool_response>\n' + m.content + '\n</tool_response>' -}}
    {%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
  {%- else -%}
    {{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\n' -}}
  {%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\n\n</think>\n\n' -}}{%- endif -%}
{%- endif -%}
"""

LLAMA31_LIKE = r"""
{{- bos_token -}}
{%- if messages[0].role == 'system' -%}{%- set sys = messages[0].content -%}{%- set rest = messages[1:] -%}
{%- else -%}{%- set sys = '' -%}{%- set rest = messages -%}{%- endif -%}
{{- '<|start_header_id|>system<|end_header_id|>\n\ncutting knowledge date: 2023\n\n' + sys + '<|eot_id|>' -}}
{%- for m in rest -%}
  {%- if m.role == 'tool' -%}
    {{- '<|start_header_id|>ipython<|end_header_id|>\n\n' -}}
    {%- if m.content is mapping or m.content is iterable -%}{{- m.content | tojson -}}{%- else -%}{{- m.content -}}{%- endif -%}
    {{- '<|eot_id|>' -}}
  {%- else -%}
    {{- '<|start_header_id|>' + m.role + '<|end_header_id|>\n\n' + (m.content | trim) + '<|eot_id|>' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}{%- endif -%}
"""

QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_response>", "</tool_response>"]
LLAMA_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>"]


def _codec(specials, template, stops, bos=None) -> TextCodec:
    """A character tokenizer with the family's special tokens (each one id), its template and stop ids."""
    vocab = {t: i for i, t in enumerate(specials + list(dict.fromkeys(CHARS)))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=specials[0]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    extra = {"bos_token": bos} if bos else {}
    return TextCodec(tok, [vocab[s] for s in stops], template, {"unk_token": specials[0], **extra})


FAMILIES = {
    "chatml": (lambda: TextCodec.tiny(LETTERS), {}),
    "qwen3": (lambda: _codec(QWEN_SPECIALS, QWEN3_LIKE, ["<|im_end|>", "<|endoftext|>"]), {"enable_thinking": False}),
    "llama31": (lambda: _codec(LLAMA_SPECIALS, LLAMA31_LIKE, ["<|eot_id|>", "<|eom_id|>"], "<|begin_of_text|>"), {}),
}
# What each family's template puts after a model turn that ended with its stop token, written out by
# hand from the format (the reference the token rule is held to): a user reply, then two tool results.
AFTER = {
    "chatml": ["\n<|im_start|>user\nlater<|im_end|>\n<|im_start|>assistant\n",
               "\n<|im_start|>tool\nseven<|im_end|>\n<|im_start|>tool\neight<|im_end|>\n<|im_start|>assistant\n"],
    "qwen3": ["\n<|im_start|>user\nlater<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n",
              "\n<|im_start|>user\n<tool_response>\nseven\n</tool_response>\n<tool_response>\neight\n</tool_response>"
              "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"],
    "llama31": ["<|start_header_id|>user<|end_header_id|>\n\nlater<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
                '<|start_header_id|>ipython<|end_header_id|>\n\n"seven"<|eot_id|><|start_header_id|>ipython<|end_header_id|>'
                '\n\n"eight"<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n'],
}
REPLIES = [[{"role": "user", "content": "later"}], [{"role": "tool", "content": "seven"}, {"role": "tool", "content": "eight"}]]


class Scripted:
    """An engine that samples what it is told (each call: one list of ids per returned completion)
    and records the prompts it was fed."""

    version = 0

    def __init__(self, turns: list[list[list[int]]], stops: list[int]):
        self.turns, self.stops, self.fed = list(turns), stops, []

    def generate(self, prompts, n, sampling, budgets=None, keep=True):
        self.fed.append([list(p) for p in prompts])
        out = []
        for ids in self.turns.pop(0):
            reason = "stop" if ids[-1] in self.stops else "length"
            out.append(Completion(list(ids), [-0.5] * len(ids), [self.version] * len(ids), reason))
        return out


class Replies:
    """An environment replying with REPLIES in order, done after the last."""

    def reset(self, row, seed):
        self.k = 0

    def step(self, text, ids):
        self.k += 1
        return (REPLIES[self.k - 1], False) if self.k <= len(REPLIES) else ([], True)

    def reward(self):
        return 1.0


def _play(codec, engine, kwargs, env=Replies, group=1, max_turns=3, limit=4096, timeout=5.0, prompt=None):
    row = D.Prompt(codec.render(prompt or [{"role": "user", "content": "guess"}], **kwargs),
                   prompt or [{"role": "user", "content": "guess"}], {"secret": "c"})
    spec = E.EnvSpec("test", env, None, True)
    pl = E.Play(spec, codec, engine, Sampling(max_new_tokens=16), limit, max_turns, timeout, kwargs)
    return E.play(pl, [row], group, [7]), row


@pytest.mark.parametrize("family", FAMILIES)
def test_an_episode_is_the_sampled_ids_and_the_templates_deltas_token_for_token(family):
    make, kwargs = FAMILIES[family]
    codec = make()
    stop = codec.stop_ids[0]
    text = "<think>\nhm\n</think>\n\nb" if family == "qwen3" else "b"  # the model's own text, special tokens and all
    turns = [codec.encode(text) + [stop], codec.encode("c") + [stop], codec.encode("d") + [stop]]
    engine = Scripted([[t] for t in turns], codec.stop_ids)
    (ep,), row = _play(codec, engine, kwargs)
    expected = list(row.ids)
    for t, after in zip(turns, AFTER[family] + [None]):
        expected += t
        if after is not None:
            expected += codec.encode(after)
    assert ep.ids == expected and ep.end == "done" and ep.n_turns == 3
    s = ep.sample()
    assert s.prompt.ids + s.completion == expected
    model = [i for i, m in zip(s.completion, s.mask) if m]  # the trained tokens: exactly what was sampled
    assert model == [i for t in turns for i in t]
    assert [t for t, m in zip(s.turns, s.mask) if m] == [0] * len(turns[0]) + [1] * len(turns[1]) + [2] * len(turns[2])
    for k, fed in enumerate(engine.fed):  # the engine was fed the episode's own ids every turn
        assert expected[:len(fed[0])] == fed[0] and (k == 0 or fed[0][-1] != stop)
    if family == "qwen3":  # serving would re-render turn 1 without its think block; training keeps what was sampled
        rerendered = codec.render(ep.messages[:-1], **kwargs)
        assert rerendered != expected[:len(rerendered)] and codec.encode(text)[0] in s.completion


@pytest.mark.parametrize("family", FAMILIES)
def test_a_reply_never_repeats_the_end_of_the_turn_the_model_sampled_whichever_stop_ended_it(family):
    """A stop token that ends a turn (ChatML/Qwen <|im_end|>, Llama <|eot_id|> and <|eom_id|>) drops the
    template's leading end of turn: a Llama turn ending <|eom_id|> is not followed by <|eot_id|>. A turn
    that ended on <|endoftext|> (a document's end) is followed by the template's <|im_end|>: that turn did not end as a turn."""
    make, kwargs = FAMILIES[family]
    codec = make()
    for stop in codec.stop_ids:
        text = codec.tok.id_to_token(stop)
        want = AFTER[family][0] if text in ("<|im_end|>", "<|eot_id|>", "<|eom_id|>") else "<|im_end|>" + AFTER[family][0]
        assert E.reply_ids(codec, REPLIES[0], stop, kwargs) == codec.encode(want), (family, text)
    end = "<|eot_id|>" if family == "llama31" else "<|im_end|>"  # no stop sampled (a turn cut by length)
    assert E.reply_ids(codec, REPLIES[0], codec.encode("b")[0], kwargs) == codec.encode(end + AFTER[family][0])


def test_a_reference_turn_ends_with_the_templates_end_of_turn_not_the_first_stop_id():
    """Llama-3.1-Instruct lists <|end_of_text|> first among its stop ids; a reference assistant turn
    ends with what the template writes after one, <|eot_id|> (here the first stop id is <|eom_id|>)."""
    codec = _codec(LLAMA_SPECIALS, LLAMA31_LIKE, ["<|eom_id|>", "<|eot_id|>"], "<|begin_of_text|>")
    eot = codec.tok.token_to_id("<|eot_id|>")
    assert E.end_of_turn(codec, {}) == eot and codec.stop_ids[0] != eot
    p = D.Prompt(codec.render([{"role": "user", "content": "guess"}]), [{"role": "user", "content": "guess"}], {})
    turns = [{"role": "assistant", "content": "b"}, {"role": "user", "content": "later"}, {"role": "assistant", "content": "c"}]
    s = E.reference(codec, p, turns, {})
    assert s.completion == codec.encode("b") + [eot] + codec.encode(AFTER["llama31"][0]) + codec.encode("c") + [eot]


def test_the_trained_ids_are_the_sampled_ones_on_a_tokenizer_that_does_not_round_trip():
    """A BPE that merges "a" + "b": the engine samples [a, b], whose text re-encodes to [ab]. A
    decode-and-re-encode design would train on other ids than were sampled; floe's episode keeps them."""
    vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    for ch in LETTERS:
        vocab.setdefault(ch, len(vocab))
    vocab["ab"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab, [("a", "b")], unk_token="<|endoftext|>"))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")])
    codec = TextCodec(tok, [2, 0], CHATML, {"unk_token": "<|endoftext|>"})
    sampled = [vocab["a"], vocab["b"], 2]
    assert codec.encode(codec.decode(sampled)) + [2] != sampled  # it does not round-trip
    engine = Scripted([[sampled], [[vocab["c"], 2]], [[vocab["d"], 2]]], [2, 0])
    (ep,), _ = _play(codec, engine, {})
    s = ep.sample()
    assert [i for i, m in zip(s.completion, s.mask) if m][:3] == sampled


def _model(seed=0):
    m = M.Transformer(M.ModelArgs(vocab_size=32, **M.TINY))
    M.init_weights(m, std=0.15, seed=seed)
    return m


@pytest.mark.parametrize("top_k", [0, 5])
def test_every_model_tokens_logq_equals_a_full_fp32_forward_of_its_episode(top_k):
    """Episodes of several turns on the built-in engine (fp32): each model token's logq, and under
    top-k its support row, against the full forward of the whole episode at the sampling temperature."""
    codec, model = TextCodec.tiny(LETTERS), _model()
    engine = TorchEngine(model, "fp32", codec.stop_ids, seed=3)
    s = Sampling(temperature=0.7, top_k=top_k, max_new_tokens=6, support=top_k > 0)

    class Chatty(Replies):
        def step(self, text, ids):
            self.k += 1
            return [{"role": "user", "content": "more"}], self.k >= 3

    row = D.Prompt(codec.render([{"role": "user", "content": "go"}]), [{"role": "user", "content": "go"}], {})
    pl = E.Play(E.EnvSpec("t", Chatty, None, True), codec, engine, s, 512, 3, 5.0, {})
    eps = E.play(pl, [row, row], 3, [1, 2])
    assert sum(e.n_turns > 1 for e in eps) >= 3  # the test covers real later turns
    for e in eps:
        sm = e.sample()
        with torch.no_grad():
            ids = torch.tensor([e.ids])
            h = model(ids[0], torch.arange(len(e.ids)), torch.zeros(len(e.ids), dtype=torch.long))
            logits = (h @ model.head_weight.T).double() / 0.7
        P = len(e.prompt.ids)
        for j, (t, on) in enumerate(zip(sm.completion, sm.mask)):
            if not on:
                continue
            z = logits[P + j - 1]
            if top_k:
                z = z.masked_fill(z < z.topk(top_k).values[-1], -math.inf)
            ref = z.log_softmax(-1)
            assert abs(sm.logq[j] - ref[t].item()) < 1e-5, (j, sm.logq[j], ref[t].item())
            if top_k:
                a, b = sm.support.host_offsets[j], sm.support.host_offsets[j + 1]
                got = dict(zip(sm.support.ids[a:b].tolist(), sm.support.logq[a:b].tolist()))
                assert set(got) == set(torch.isfinite(ref).nonzero()[:, 0].tolist())
                assert all(abs(v - ref[i].item()) < 2e-5 for i, v in got.items())
        assert all(sm.support is None or sm.support.host_offsets[j + 1] == sm.support.host_offsets[j]
                   for j, on in enumerate(sm.mask) if not on)  # replies carry no support rows


def _episode_samples(seed=0):
    """Episodes with real sampled turns (built-in engine) and advantages, for the packed step."""
    codec, model = TextCodec.tiny(LETTERS), _model(seed)
    engine = TorchEngine(model, "bf16", codec.stop_ids, seed=1)

    class Two(Replies):
        def step(self, text, ids):
            self.k += 1
            return [{"role": "user", "content": "again"}], self.k >= 2

    row = D.Prompt(codec.render([{"role": "user", "content": "go"}]), [{"role": "user", "content": "go"}], {})
    pl = E.Play(E.EnvSpec("t", Two, None, True), codec, engine, Sampling(max_new_tokens=5), 512, 3, 5.0, {})
    eps = E.play(pl, [row, row], 3, [1, 2])
    samples = [e.sample() for e in eps]
    g = torch.Generator().manual_seed(0)
    for s in samples:
        s.advantage = float(torch.randn((), generator=g))
    return model, samples


@pytest.mark.parametrize("agg", ["token", "sequence"])
def test_a_packed_multi_turn_step_equals_a_dense_unpacked_reference(agg):
    """ppo at one epoch (rho = 1: the gradient is -A * grad log p over the model tokens / N): the
    packed, prompt-sharing step's loss and gradient against each episode forwarded alone, densely,
    with the model-token mask (fp32, 1e-5). Garbage evidence on the environment's tokens changes
    nothing and fails no check: nothing reads it."""
    model, samples = _episode_samples()
    assert any(not all(s.mask) for s in samples)
    for s in samples:  # what a reply token carries is never read
        s.logq = [lq if m else math.nan for lq, m in zip(s.logq, s.mask)]
        s.versions = [v if m else -99 for v, m in zip(s.versions, s.mask)]
    cfg = C.Config(loss="ppo", env="t", task="jsonl:x", micro_batch_tokens=128, loss_agg=agg)
    packed = M.Transformer(model.args)
    packed.load_state_dict(model.state_dict())
    mbs, denom, _ = train.prepare(cfg, samples, 32, "cpu")
    assert len(mbs) > 1
    metrics = reduce_metrics(train.backward_pass(cfg, packed, packed, mbs, denom, step=0))
    n_model = sum(sum(s.mask) for s in samples)
    assert denom.tokens == n_model
    dense = M.Transformer(model.args)
    dense.load_state_dict(model.state_dict())
    total = 0.0
    for s in samples:
        ids = torch.tensor(s.ids)
        h = dense(ids[:-1], torch.arange(len(ids) - 1), torch.zeros(len(ids) - 1, dtype=torch.long))
        logp = (h @ dense.head_weight.T).log_softmax(-1).gather(1, ids[1:, None])[:, 0]
        on = torch.tensor([False] * (len(s.prompt.ids) - 1) + s.mask)
        norm = n_model if agg == "token" else sum(s.mask) * len(samples)  # an episode is one sequence
        term = -(s.advantage * torch.exp(logp - logp.detach()))[on].sum() / norm
        term.backward()
        total += term.item()
    if agg == "token":
        assert metrics["loss"] == pytest.approx(total, abs=1e-5)  # (sum, count) over micro-batches: the global loss
    for (name, a), b in zip(packed.named_parameters(), dense.parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-5, msg=name)
    assert "by_turn/mismatch_kl/1" in metrics and "by_turn/mismatch_kl/0" in metrics


def test_the_multi_turn_sft_reference_trains_the_assistant_turns_under_the_token_rule():
    codec = TextCodec.tiny(LETTERS)
    p = D.Prompt(codec.render([{"role": "user", "content": "guess"}]), [{"role": "user", "content": "guess"}], {})
    turns = [{"role": "assistant", "content": "b"}, {"role": "user", "content": "later"}, {"role": "assistant", "content": "c"}]
    s = E.reference(codec, p, turns, {})
    b, c = codec.encode("b") + [2], codec.encode("c") + [2]
    assert s.completion == b + codec.encode(AFTER["chatml"][0]) + c
    assert [i for i, m in zip(s.completion, s.mask) if m] == b + c
    with pytest.raises(ValueError, match="start with an assistant"):
        E.reference(codec, p, [{"role": "user", "content": "x"}], {})


# ----------------------------------------------------------------------------- faults

class Boom(Replies):
    def step(self, text, ids):
        raise KeyError("the tool broke")


class Exits(Replies):
    def step(self, text, ids):
        sys.exit(3)


class Hangs(Replies):
    def step(self, text, ids):
        import time
        time.sleep(3600)


class NotAList(Replies):
    def step(self, text, ids):
        return "later", False


class Unknown(Replies):
    def step(self, text, ids):
        return [{"role": "user", "content": "LATER!"}], False  # capitals and "!" are not in the tokenizer


class Long(Replies):
    def step(self, text, ids):
        return [{"role": "user", "content": "x" * 300}], False


class FirstNumbers(Replies):
    def reset(self, row, seed):
        return [1, 2, 3]


class FirstNoContent(Replies):
    def reset(self, row, seed):
        return [{"role": "user"}]


class FirstNoRole(Replies):
    def reset(self, row, seed):
        return [{"content": "guess"}]


class DoneNo(Replies):
    def step(self, text, ids):
        return [], "no"  # bool("no") is True


class NumpyReward(Replies):
    def step(self, text, ids):
        return [], np.True_

    def reward(self):
        return np.float32(0.5)


class StringReward(Replies):
    def step(self, text, ids):
        return [], True

    def reward(self):
        return "1.0"


@pytest.mark.parametrize("env,end,why", [(Boom, "error", "KeyError"), (Exits, "error", "SystemExit(3)"),
                                         (Hangs, "timeout", "timed out"), (NotAList, "bad_reply", "not a list of"),
                                         (Unknown, "bad_reply", "not in the tokenizer"),
                                         (FirstNumbers, "bad_reply", "reset returned [1, 2, 3], not a prompt"),
                                         (FirstNoContent, "bad_reply", "reset returned [{'role': 'user'}], not a prompt"),
                                         (FirstNoRole, "bad_reply", "not a prompt (None, a string, or a list of"),
                                         (DoneNo, "bad_reply", "step's done is str 'no' is not a bool"),
                                         (StringReward, "error", "reward returned str '1.0' is not a number")])
def test_an_environment_fault_takes_its_group_out_with_its_cause(env, end, why):
    codec = TextCodec.tiny(LETTERS)
    stop = codec.stop_ids[0]
    engine = Scripted([[[5, stop], [6, stop]]], codec.stop_ids)
    eps, _ = _play(codec, engine, {}, env=env, group=2, timeout=0.3)
    assert eps[0].end == end and why in eps[0].why and eps[1].end in (end, "dropped")
    task = type("T", (), {"rewards": [], "codec": codec})()
    pl = E.Play(E.EnvSpec("x", env, None, True), codec, engine, Sampling(), 99, 3, 1.0, {})
    assert rollout.finish_episodes(pl, task, eps, 2) == [] and why in pl.last_error
    assert rollout.episode_stats(eps, 3)["skipped/env_error"] == (2.0, 2.0)


def test_an_environment_reward_of_any_real_type_and_a_numpy_done_are_taken():
    """np.float32, np.int64, a 0-d tensor and a bool are numbers (bool as 0 or 1); np.bool_ is a bool."""
    codec = TextCodec.tiny(LETTERS)
    stop = codec.stop_ids[0]
    for value, want in ((np.float32(0.5), 0.5), (np.int64(1), 1.0), (torch.tensor(0.25), 0.25), (True, 1.0)):
        env = type("E", (NumpyReward,), {"reward": lambda self, v=value: v})
        eps, _ = _play(codec, Scripted([[[5, stop], [6, stop]]], codec.stop_ids), {}, env=env, group=2)
        assert [(e.end, e.reward) for e in eps] == [("done", want)] * 2


def test_a_reply_that_overflows_the_budget_ends_the_episode_before_it():
    codec = TextCodec.tiny(LETTERS)
    stop = codec.stop_ids[0]
    engine = Scripted([[[5, stop]]], codec.stop_ids)
    (ep,), row = _play(codec, engine, {}, env=Long, limit=120)
    assert ep.end == "budget" and ep.ids == row.ids + [5, stop] and ep.n_turns == 1
    assert ep.sample().finish_reason == "length"


def _env_file(tmp_path, body: str) -> Path:
    f = tmp_path / "myenv.py"
    f.write_text(textwrap.dedent(body))
    return f


FLAGS = ["--task", "jsonl:examples/guess.jsonl", "--model", "checkpoints/guess-tiny", "--steps", "2",
         "--prompts-per-step", "2", "--group-size", "2", "--eval-every", "0", "--max-new-tokens", "3", "--max-turns", "2"]


def test_a_hung_environment_is_abandoned_the_run_goes_on_and_exits_cleanly(tmp_path):
    """An environment whose step never returns on half the rows: those groups time out and are
    counted, the others train, and the process exits 0 at the end (no thread keeps it alive)."""
    f = _env_file(tmp_path, """
        import time
        from agents.envs import GuessLetter
        class Sleepy(GuessLetter):
            def step(self, text, ids):
                if self.secret < "i":
                    time.sleep(3600)
                return super().step(text, ids)
    """)
    r = subprocess.run([sys.executable, "train.py", *FLAGS, "--env", f"{f}:Sleepy", "--call-timeout", "0.5",
                        "--out-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "step timed out" in r.stdout and (tmp_path / "run" / "final").exists()


def test_a_run_whose_episodes_all_fail_stops_in_one_line(tmp_path, capsys):
    f = _env_file(tmp_path, """
        class Broken:
            def reset(self, row, seed):
                raise RuntimeError("no database")
            def step(self, text, ids):
                return [], True
            def reward(self):
                return 0.0
    """)
    with pytest.raises(SystemExit) as e:
        train.main([*FLAGS, "--steps", "5", "--env", f"{f}:Broken", "--out-dir", str(tmp_path / "run")])
    assert e.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "every episode failed 3 steps in a row" in err[0] and "reset raised RuntimeError: no database" in err[0]


def test_a_first_prompt_longer_than_the_context_is_named_as_the_cause(tmp_path, capsys):
    """reset's prompt leaves no room for a turn in any group: counted in skipped/too_long, and the run
    that trained nothing names the prompt's length, not the rewards."""
    f = _env_file(tmp_path, """
        from agents.envs import GuessLetter
        class Wordy(GuessLetter):
            def reset(self, row, seed):
                super().reset(row, seed)
                return "a" * 5000
    """)
    with pytest.raises(SystemExit) as e:
        train.main([*FLAGS, "--env", f"{f}:Wordy", "--out-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 1 and len(err) == 1 and "every prompt is longer than the context" in err[0], err
    rows = [__import__("json").loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped/too_long"] for r in rows] == [1.0, 1.0]


def test_threads_an_environment_leaves_running_do_not_keep_the_process_alive(tmp_path):
    f = _env_file(tmp_path, """
        import threading, time
        from agents.envs import GuessLetter
        class Leaky(GuessLetter):
            def step(self, text, ids):
                threading.Thread(target=time.sleep, args=(3600,), name="leaky", daemon=False).start()
                return super().step(text, ids)
    """)
    r = subprocess.run([sys.executable, "train.py", *FLAGS, "--steps", "1", "--env", f"{f}:Leaky",
                        "--out-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0 and (tmp_path / "run" / "final").exists(), r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    assert lines[-2].startswith("summary ") and "thread(s) that user code started are still running" in lines[-1] and "(leaky" in lines[-1]


@pytest.mark.parametrize("spec,words", [("nowhere.py:Env", "no such file"), ("agents.envs:Missing", "has no class 'Missing'"),
                                        ("agents.envs:SECRETS", "is not a class"), ("data:Prompt", "Prompt.step is not a method"),
                                        ("{f}:NoReward", "has no reward() and no --reward"), ("{f}:Exits", "SystemExit(0)")])
def test_a_bad_env_is_refused_before_the_first_byte(tmp_path, capsys, spec, words):
    f = _env_file(tmp_path, """
        class NoReward:
            def step(self, text, ids):
                return [], True
    """)
    spec = spec.format(f=f)
    if spec.endswith("Exits"):
        f.write_text(f.read_text() + "\nraise SystemExit(0)\n")  # an environment file that exits at import
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        train.main([*FLAGS, "--env", spec, "--out-dir", str(out)])
    assert e.value.code == 2 and words in capsys.readouterr().err and not out.exists()


def test_a_row_without_a_column_the_environment_declares_is_refused_at_its_line(tmp_path, capsys):
    """GuessLetter.columns names `secret`: a row without it (the 41st, say) would fail its group's reset at
    every draw, so the start refuses it by its line, before the first byte, as a reward's columns are."""
    rows = (ROOT / "examples" / "guess.jsonl").read_text().splitlines()[:80]
    bad = json.loads(rows[40])
    del bad["secret"]
    rows[40] = json.dumps(bad)
    f = tmp_path / "rows.jsonl"
    f.write_text("\n".join(rows) + "\n")
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        train.main([*FLAGS, "--task", f"jsonl:{f}", "--env", "guess-letter", "--eval-prompts", "8", "--out-dir", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and not out.exists()
    assert err == [f"floe: error: {f}:41: --env guess-letter needs the column(s) ['secret'], which this row lacks "
                   "(it has ['episode'])"], err


def test_columns_that_are_not_names_are_refused(tmp_path, capsys):
    f = _env_file(tmp_path, """
        from agents.envs import GuessLetter
        class OneString(GuessLetter):
            columns = "secret"
    """)
    with pytest.raises(SystemExit) as e:
        train.main([*FLAGS, "--env", f"{f}:OneString", "--out-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "OneString.columns must be a tuple of column names, got 'secret'" in err[0]


def _old_guess_rows(n: int, seed: int) -> list[dict]:
    """What envs.write_rows wrote before every built-in environment wrote its own rows."""
    rng, out = random.Random(seed), []
    for _ in range(n):
        secret = rng.choice(envs.SECRETS)
        out.append({"prompt": [{"role": "user", "content": envs.PROMPT}], "secret": secret,
                    "episode": envs.bisection(secret)})
    return out


def test_every_builtin_environment_writes_its_rows_by_name(tmp_path):
    """`python -m agents.envs NAME FILE`: guess-letter's rows are the old writer's, byte for byte the committed
    examples/guess.jsonl; the blind control plays the same rows (and the calculator's control the
    calculator's); each holds the columns its class declares."""
    for name, cls in envs.BUILTIN.items():
        f = tmp_path / f"{name}.jsonl"
        r = subprocess.run([sys.executable, "-m", "agents.envs", name, str(f)], capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert r.returncode == 0 and not r.stderr, r.stderr
        if name.startswith("guess-letter"):
            assert f.read_bytes() == (ROOT / "examples" / "guess.jsonl").read_bytes()
        assert f.read_bytes() == (tmp_path / f"{name.removesuffix('-off').removesuffix('-blind')}.jsonl").read_bytes()
        assert cls.columns and all(set(cls.columns) <= row.keys() for row in cls.rows(16, 0))
    assert envs.GuessLetter.rows(20, 3) == _old_guess_rows(20, 3)


@pytest.mark.parametrize("args,words", [(["nope", "x.jsonl"], "no built-in environment 'nope'"),
                                       (["examples/x.jsonl"], "2 arguments, got 1")])
def test_envs_py_with_an_unknown_name_says_its_usage_in_one_line(tmp_path, args, words):
    r = subprocess.run([sys.executable, "-m", "agents.envs", *args], capture_output=True, text=True, timeout=60,
                       cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
    one_line(r, 2, words, "usage: python -m agents.envs NAME FILE, NAME one of guess-letter, guess-letter-blind, calculator, "
             "calculator-off")
    assert not list(tmp_path.iterdir())  # nothing written


@pytest.mark.parametrize("turn", [{"role": "assistant"}, {"role": "user"}, {"content": "later"}])
def test_an_sft_episode_with_a_turn_lacking_its_content_is_refused_at_its_line(tmp_path, capsys, turn):
    """An assistant turn or a reply without `content` (or `role`) would train an empty turn: the start refuses
    the row by its line, before the first byte."""
    rows = (ROOT / "examples" / "guess.jsonl").read_text().splitlines()[:80]
    bad = __import__("json").loads(rows[40])
    bad["episode"] = [{"role": "assistant", "content": "h"}, turn, {"role": "assistant", "content": "d"}]
    rows[40] = __import__("json").dumps(bad)
    f = tmp_path / "rows.jsonl"
    f.write_text("\n".join(rows) + "\n")
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        train.main([*FLAGS, "--task", f"jsonl:{f}", "--env", "guess-letter", "--stage", "sft", "--eval-prompts", "8",
                    "--eval-file", "examples/guess.jsonl", "--out-dir", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and not out.exists()
    assert f"{f}:41: `episode` is not a multi-turn reference" in err[0] and "'content': str} messages" in err[0], err[0]


def test_an_environment_run_trains_and_logs_its_episode_metrics(tmp_path):
    s = train.main([*FLAGS, "--env", "guess-letter", "--eval-every", "2", "--eval-prompts", "4",
                    "--out-dir", str(tmp_path / "run")])
    rows = [__import__("json").loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and "eval/turns" in rows[-1] and "eval/reward" in s
    for k in ("episode/turns", "episode/model_tokens", "episode/env_tokens", "episode/end/done", "by_turn/mismatch_kl/0"):
        assert k in rows[1], k


def test_the_documented_environment_runs_as_written(tmp_path):
    """docs/agents.md's ten lines are examples/countdown.py, verbatim: they train."""
    doc = (ROOT / "docs" / "agents.md").read_text()
    code = doc.split("```python\n")[1].split("```")[0]
    assert code in (ROOT / "examples" / "countdown.py").read_text()
    train.main(["--task", "jsonl:examples/sums.jsonl", "--env", "examples/countdown.py:Countdown", "--model",
                "checkpoints/arith-tiny", "--steps", "1", "--prompts-per-step", "2", "--group-size", "2",
                "--eval-every", "0", "--max-new-tokens", "4", "--out-dir", str(tmp_path / "run")])
    row = __import__("json").loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert row["episode/turns"] >= 1 and row["skipped/env_error"] == 0


def test_a_resumed_multi_turn_run_repeats_the_uninterrupted_one(tmp_path):
    """The environments' seeds come from the run's RNG, which the checkpoint saves: a resume plays
    the same episodes, and every metric of every step repeats exactly."""
    flags = [*FLAGS, "--env", "guess-letter", "--save-every", "1"]
    train.main([*flags, "--steps", "3", "--out-dir", str(tmp_path / "a")])
    train.main([*flags, "--steps", "1", "--out-dir", str(tmp_path / "b")])
    train.main([*flags, "--steps", "3", "--out-dir", str(tmp_path / "b"), "--resume"])

    def rows(d):
        return [{k: v for k, v in __import__("json").loads(x).items() if not k.startswith("time/")}
                for x in (d / "metrics.jsonl").read_text().splitlines()]

    assert rows(tmp_path / "a") == rows(tmp_path / "b")
    assert any(r.get("episode/turns", 0) > 1 for r in rows(tmp_path / "a"))
