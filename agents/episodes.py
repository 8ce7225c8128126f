"""Multi-turn episodes: the token rule and the episode loop, on top of any engine.

An episode starts from a row of `--task jsonl:FILE`; the model answers, the environment (agents/envs.py
has the contract) replies with messages and says whether it is done, the model answers again,
and the reward comes at the end. `play` runs a step's episodes; rollout.py turns them into the
step's Samples (`finish_episodes`) and scores the held-out rows (`evaluate_episodes`).

With tools declared (--tool, or an environment's `tools()`), each model turn is first read for
calls in the family's format (agents/toolcalls.py parses the sampled ids decoded with special tokens
kept); a call turn's results (agents/toolrun.py runs them) are its reply, by the same token rule, and
any other turn is the answer: the environment's `step` judges it, or, without one, it ends the
episode. The tools' schemas reach the template as its `tools` keyword, in the first prompt and in
every reply.

The token rule, exact by construction: an episode's ids are the first prompt's ids, then each
model turn's ids exactly as the engine sampled them (its stop token included), then each reply's
ids, and so on. Nothing is ever decoded and re-encoded. A reply's ids (`reply_ids`) are the chat
template's text after an assistant message in a fixed dummy conversation (the end-of-turn text
the model did not emit, such as ChatML's "\\n" after <|im_end|>, the reply's messages, the next
assistant header), so they never depend on re-rendering the history; the engine is fed these
same ids for the next turn, so engine and trainer see one sequence. A template that would render
earlier turns differently when serving (Qwen3 drops earlier turns' <think> blocks) does not
change what is trained: the trainer scores what the engine saw (docs/agents.md).

Only the model's tokens are trained (`Sample.mask`); the prompt and the replies are context,
attended to and never trained, with no sampler evidence. Each model token keeps its own logq,
support row and version, so every loss, mask and KL works per token unchanged, and an episode is
one sequence (one document) for --loss-agg sequence, GSPO and the sequence masks.

Simplifications:
1. One batched engine call per turn over every live episode (the first turn: one prompt per
   group, n = --group-size); an episode that ended drops out; nothing is carried into the next
   step. Each turn's prompts are the episodes' whole ids: the contract stays one stateless
   `generate`, and the engines keep the prefix themselves (the built-in engine its last call's
   cache rows, engines/torch_engine.py; vLLM its prefix cache), until `idle()` after the step's last turn.
   bench/turns.py measures what keeping the rows saves (docs/experiments.md "2026-12-02: the cost
   of a turn"): an episode against a single turn of the same total tokens, rows kept or not.
2. Every call into the environment goes through tasks/usercode.py: a thread of its own with
   --call-timeout, all of a turn's episodes at once, on copies of floe's data.
3. Faults take the whole group out (`skipped/env_error`): an environment that raised or timed
   out, a reply that is not a list of {"role", "content"} messages or holds characters the
   tokenizer lacks. Keeping the rest would centre the group's advantage on the episodes the
   failure spared, which are not a random sample of the group (tinker-cookbook makes the same
   choice). A run whose episodes all fail three steps in a row stops, naming the error.
4. The budget: an episode's ids must fit the context and one packing buffer
   (--micro-batch-tokens + 1). Each turn may sample up to --max-new-tokens within the room left;
   a reply that would leave no room for another turn ends the episode there ("budget"), before
   the reply, and so does a turn cut by the budget. A turn cut by --max-new-tokens ends it as
   truncated ("length").

    python train.py --task jsonl:examples/guess.jsonl --env guess-letter --model checkpoints/guess-tiny
"""

from __future__ import annotations

import copy
import json
import math
import threading
from dataclasses import dataclass, field
from pathlib import Path

from data import Prompt, RunError, Sample, TokenSupport, is_messages
from agents import toolcalls, toolrun, toolschema
from engines.torch_engine import Completion, Sampling
from tasks import usercode
from tasks.textcodec import TextCodec

ENDS = ("done", "max_turns", "length", "budget", "timeout", "error", "bad_reply", "dropped")
FAULTS = ("timeout", "error", "bad_reply")  # the ends that take their group out
LOST = FAULTS + ("dropped",)  # the ends whose episodes neither score nor train (a fault, or its group's)
DUMMY = [{"role": "user", "content": "floe-dummy-user"}]  # the fixed history a reply is rendered after
MARK = "floe-dummy-turn"  # the dummy assistant turn's content: the reply is what the template puts after it
TURN_ENDS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>")  # stop tokens that end an assistant turn (ChatML, Qwen; Llama 3)


# ----------------------------------------------------------------------------- the environment

@dataclass
class EnvSpec:
    """The --env class (envcheck.load_env checks it), where it came from, and which of the optional
    methods it has."""

    name: str
    cls: type
    source: Path | None
    has_reward: bool
    has_step: bool = True  # without one (an environment with tools), a turn that is no call ends the episode
    has_tools: bool = False  # tools(self), read after reset


def _start(cls: type, row: dict, seed: int, has_tools: bool):
    env = cls()
    first = env.reset(row, seed) if hasattr(env, "reset") else None
    return env, first, (list(env.tools()) if has_tools else [])


def _reply(value) -> tuple[list[dict], bool]:
    """A step's return value checked: (messages, done); ValueError saying what is wrong."""
    if not (isinstance(value, tuple) and len(value) == 2):
        raise ValueError(f"step returned {type(value).__name__}, not a (messages, done) pair")
    messages, done = value
    if not is_messages(messages):
        raise ValueError(f"step's reply is not a list of {{'role': str, 'content': str}} messages: {str(messages)[:80]}")
    try:
        return messages, usercode.flag(done)
    except TypeError as e:
        raise ValueError(f"step's done is {e} (True or False)") from None


def _first(value):
    """reset's return value checked: None (the row's prompt), a string, or a non-empty list of messages."""
    if value is None or isinstance(value, str) or (is_messages(value) and value):
        return value
    raise ValueError(f"reset returned {str(value)[:80]}, not a prompt (None, a string, or a list of "
                     "{'role': str, 'content': str} messages)")


# ----------------------------------------------------------------------------- the token rule

def reply_ids(codec: TextCodec, messages: list[dict], last: int, template_kwargs: dict) -> list[int]:
    """The ids that follow a model turn ending with token `last`: the template's text after an
    assistant turn in a fixed dummy conversation, then `messages`, then the next assistant header.
    The reply never holds a second end of the assistant turn: when `last` is a stop token that ends a
    turn (the one the template writes, or any of TURN_ENDS: a Llama turn may end on <|eom_id|> where
    the template writes <|eot_id|>), the template's leading end of turn is dropped; a turn that ended
    on a stop token that ends a document (<|endoftext|>) is followed by the template's. ValueError if
    the template hides the turn's content or the text holds characters the tokenizer lacks."""
    after = _after_turn(codec, messages, template_kwargs)
    if last in codec.stop_ids:  # the model sampled its end of turn: the template's copy of it is not repeated
        stop = codec.tok.decode([last], skip_special_tokens=False)
        ends = [stop] + (list(TURN_ENDS) if stop in TURN_ENDS else [])
        lead = next((t for t in ends if t and after.startswith(t)), "")
        after = after[len(lead):]
    return codec.encode(after)


def _after_turn(codec: TextCodec, messages: list[dict], template_kwargs: dict) -> str:
    text = codec.render_text(DUMMY + [{"role": "assistant", "content": MARK}] + messages, True, **template_kwargs)
    at = text.find(MARK)
    if at < 0:
        raise ValueError("the chat template does not render an assistant turn's content as it is")
    return text[at + len(MARK):]


def end_of_turn(codec: TextCodec, template_kwargs: dict) -> int:
    """The stop id the template writes after an assistant turn (Qwen <|im_end|>, Llama <|eot_id|>),
    read from the rendered dummy turn: what a reference turn ends with. Llama-3.1-Instruct's first stop
    id is <|end_of_text|>, which no assistant turn ends with; a template that writes no stop id there
    gets the first stop id (generation must be able to stop)."""
    ids = codec.encode(_after_turn(codec, [], template_kwargs))
    return ids[0] if ids and ids[0] in codec.stop_ids else codec.stop_ids[0]


# ----------------------------------------------------------------------------- the loop

@dataclass
class Episode:
    """One episode being played: its ids so far and, per token after the first prompt, what the
    loss needs (the Sample it becomes)."""

    group: int  # its row's index in the step
    env: object
    prompt: Prompt  # the first prompt (ids, as the task or reset gave it, the row's columns)
    ids: list[int] = field(default_factory=list)  # prompt and everything after: the engine's next prompt
    mask: list[bool] = field(default_factory=list)  # per token after the prompt: sampled by the model
    turns: list[int] = field(default_factory=list)  # the model turn of each such token, -1 on a reply
    logq: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    support: list[TokenSupport] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)  # the conversation as text, for --reward
    last: list[int] = field(default_factory=list)  # the last model turn's ids
    n_turns: int = 0
    end: str = ""  # "" while it goes on, else one of ENDS
    why: str = ""  # the environment's error, for the line that stops a run
    reward: float = math.nan
    kwargs: dict = field(default_factory=dict)  # the template's keywords, its tools' schemas among them
    tools: dict = field(default_factory=dict)  # the tools it may call (toolschema.Tool by name)
    calls: list = field(default_factory=list)  # its call attempts (toolcalls.Call), results filled in
    call_turns: int = 0  # model turns that were calls
    result_tokens: int = 0  # tokens of its tool replies
    on_call: bool = False  # its last model turn was a call (then no answer scores)

    def add_turn(self, c: Completion, turn: int, codec: TextCodec) -> None:
        n = len(c.ids)
        self.ids += c.ids
        self.mask += [True] * n
        self.turns += [turn] * n
        self.logq += c.logq
        self.versions += c.versions
        if c.support is not None:
            self.support.append(c.support)
        self.last, self.n_turns = list(c.ids), turn + 1
        self.messages.append({"role": "assistant", "content": codec.decode(c.ids)})

    def add_reply(self, ids: list[int], messages: list[dict]) -> None:
        n = len(ids)
        self.ids += ids
        self.mask += [False] * n
        self.turns += [-1] * n
        self.logq += [0.0] * n
        self.versions += [0] * n
        if self.support:
            self.support.append(TokenSupport.empty(n))
        self.messages += messages

    def sample(self) -> Sample:
        support = TokenSupport.cat(self.support) if self.support else None
        return Sample(self.prompt, self.ids[len(self.prompt.ids):], self.logq, self.versions,
                      "length" if self.end in ("length", "budget") else "stop", support, self.reward,
                      mask=self.mask, turns=self.turns)


@dataclass
class Play:
    """What `play` needs besides the rows: the environment, the engine and the limits."""

    spec: EnvSpec
    codec: TextCodec
    engine: object
    sampling: Sampling
    limit: int  # an episode's ids at most: the context, and one packing buffer + 1
    max_turns: int
    timeout: float
    template_kwargs: dict
    last_error: str = ""  # the newest environment error, for the line that stops a run
    stop: threading.Event | None = None  # set when the run shuts down: a call still running is abandoned at once
    tools: toolrun.Tools | None = None  # declared tools (--tool, an environment's tools()): calls are parsed and run
    tool_seconds: float = 0.0  # this play's wall time in tool calls (time/tools)


def play(pl: Play, rows: list[Prompt], group: int, seeds: list[int]) -> list[Episode]:
    """`group` episodes per row, played to their end: one engine call per turn over every live
    episode, the environment's calls of a turn all at once."""
    pl.tool_seconds = 0.0
    eps = _start_all(pl, rows, group, seeds)
    for turn in range(pl.max_turns):
        live = [e for e in eps if not e.end]
        if not live:
            break
        room = [pl.limit - len(e.ids) for e in live]
        keep = turn + 1 < pl.max_turns  # the next turn extends these rows: the engine may keep their caches
        if turn == 0:  # a group's episodes share the prompt: prefill it once, n = group
            outs = pl.engine.generate([e.ids for e in live[::group]], group, pl.sampling, room[::group], keep)
        else:
            outs = pl.engine.generate([e.ids for e in live], 1, pl.sampling, room, keep)
        for e, c, r in zip(live, outs, room):
            e.add_turn(c, turn, pl.codec)
            if c.finish_reason == "length":  # truncated: by --max-new-tokens, or by the room left
                e.end = "budget" if len(c.ids) == r < pl.sampling.max_new_tokens else "length"
        _environment_turn(pl, [e for e in live if not e.end], turn)
        _drop_failed_groups(eps, group)
    for e in eps:
        e.end = e.end or "max_turns"
    _rewards(pl, [e for e in eps if e.end not in LOST])
    _drop_failed_groups(eps, group)
    return eps


def _start_all(pl: Play, rows: list[Prompt], group: int, seeds: list[int]) -> list[Episode]:
    """One environment per episode, reset from its row and its group's seed; a group's first
    prompts must agree (packing shares them, advantages are centred on them)."""
    calls = [(lambda p=p, s=s: _start(pl.spec.cls, copy.deepcopy({"prompt": p.prompt, **p.columns}), s, pl.spec.has_tools))
             for p, s in zip(rows, seeds) for _ in range(group)]
    eps = []
    for i, res in enumerate(usercode.call_all(calls, pl.timeout, pl.stop)):
        row = rows[i // group]
        e = Episode(i // group, None, row, kwargs=pl.template_kwargs, tools=pl.tools.fns if pl.tools else {})
        eps.append(e)
        if not res.ok:
            e.end, e.why = ("timeout", "reset timed out") if res.timed_out else ("error", f"reset raised {res.error}")
            continue
        e.env, first, env_tools = res.value
        try:
            first = _first(first)
            if env_tools:  # this episode's own tools: their schemas join the first prompt, read now
                e.tools = toolschema.toolset([t.fn for t in e.tools.values()] + env_tools)
                e.kwargs = {**pl.template_kwargs, "tools": [t.schema for t in e.tools.values()]}
            raw = row.prompt if first is None else first
            if pl.tools and isinstance(raw, str):
                raise ValueError("a string prompt cannot show the tools (the chat template does)")
            if first is not None or env_tools:
                e.prompt = Prompt(pl.codec.render(raw, **e.kwargs), raw, row.columns, row.reference, row.where)
        except ValueError as err:  # unknown characters, a template that cannot render it, a tool without a schema
            e.end, e.why = "bad_reply", f"reset's prompt: {err}"
            continue
        e.ids = list(e.prompt.ids)
        raw = e.prompt.prompt
        e.messages = copy.deepcopy(raw) if isinstance(raw, list) else [{"role": "user", "content": raw}]
        if len(e.ids) + 1 > pl.limit:
            e.end = "budget"
    for g in range(len(rows)):
        if len({json.dumps(e.kwargs.get("tools")) for e in eps[g * group:(g + 1) * group] if not e.end}) > 1:
            raise RunError(f"--env {pl.spec.name}: tools() gave different tools for one row and seed; they must "
                           "depend on (row, seed) alone (their schemas are part of the group's first prompt)")
        firsts = {tuple(e.ids) for e in eps[g * group:(g + 1) * group] if not e.end}
        if len(firsts) > 1:
            raise RunError(f"--env {pl.spec.name}: reset gave different first prompts for one row and seed; "
                           "it must depend on (row, seed) alone (every episode of a group starts alike)")
    _drop_failed_groups(eps, group)
    for g in range(len(rows)):  # a group whose prompt leaves no room is skipped, as a too-long prompt is
        if any(e.end == "budget" and not e.n_turns for e in eps[g * group:(g + 1) * group]):
            for e in eps[g * group:(g + 1) * group]:
                e.end = e.end or "budget"
    return eps


def _environment_turn(pl: Play, eps: list[Episode], turn: int) -> None:
    """Each live episode's turn answered: a tool call by its results (`_run_calls`), an answer by the
    environment's step (without a step, an answer ends the episode), all of a turn's at once."""
    answers = _run_calls(pl, eps, turn) if pl.tools else eps
    if not pl.spec.has_step:
        for e in answers:
            e.end = "done"
        return
    calls = [(lambda e=e: e.env.step(pl.codec.decode(e.last), list(e.last))) for e in answers]
    for e, res in zip(answers, usercode.call_all(calls, pl.timeout, pl.stop)):
        if not res.ok:
            e.end, e.why = ("timeout", "step timed out") if res.timed_out else ("error", f"step raised {res.error}")
            continue
        try:
            messages, done = _reply(res.value)
            if done or turn == pl.max_turns - 1:
                e.end = "done" if done else "max_turns"
                continue
            ids = reply_ids(pl.codec, messages, e.last[-1], e.kwargs)
        except ValueError as err:
            e.end, e.why = "bad_reply", str(err)
            continue
        _append(pl, e, ids, copy.deepcopy(messages))


def _append(pl: Play, e: Episode, ids: list[int], messages: list[dict]) -> None:
    if len(e.ids) + len(ids) + 1 > pl.limit:  # no room for another turn: the episode ends before the reply
        e.end = "budget"
    else:
        e.add_reply(ids, messages)


def _run_calls(pl: Play, eps: list[Episode], turn: int) -> list[Episode]:
    """The turn's call attempts parsed (toolcalls.parse reads the sampled ids decoded with special tokens
    kept) and run, episodes at once (toolrun.Runner), each episode's results its reply; the episodes
    whose turn is an answer are returned. A call on the last turn ends the episode (no turn reads it)."""
    t, answers, callers = pl.tools, [], []
    for e in eps:
        text, stop = pl.codec.decode_turn(e.last)
        calls = toolcalls.parse(t.fmt, text, e.tools, stop, t.limit(), len(e.calls), t.max_calls)
        e.on_call = bool(calls)
        if not calls:
            answers.append(e)
            continue
        e.calls, e.call_turns = e.calls + calls, e.call_turns + 1
        e.messages[-1] = toolcalls.assistant_message(text, calls)  # TRL's shape, for --reward
        if turn == pl.max_turns - 1:
            e.end = "max_turns"
        else:
            callers.append((e, calls))
    pl.tool_seconds += t.runner.run([c for _, c in callers], [e.tools for e, _ in callers], pl.stop)
    for e, calls in callers:
        messages = toolcalls.tool_messages(calls)
        try:
            ids = reply_ids(pl.codec, messages, e.last[-1], e.kwargs)
        except ValueError as err:  # a template that cannot render them, characters the tokenizer lacks
            e.end, e.why = "bad_reply", f"tool results: {err}"
            continue
        _append(pl, e, ids, messages)
        e.result_tokens += len(ids) if not e.end else 0
    return answers


def _rewards(pl: Play, eps: list[Episode]) -> None:
    """The environment's own reward (a fault if it raises or is not a finite number)."""
    if not pl.spec.has_reward:
        for e in eps:
            e.reward = 0.0
        return
    for e, res in zip(eps, usercode.call_all([e.env.reward for e in eps], pl.timeout, pl.stop)):
        try:
            if not res.ok:
                raise ValueError("reward timed out" if res.timed_out else f"reward raised {res.error}")
            try:
                value = usercode.number(res.value)
            except TypeError as err:
                raise ValueError(f"reward returned {err}") from None
            if not math.isfinite(value):
                raise ValueError(f"reward returned {value!r}, not a finite number")
            e.reward = value
        except ValueError as err:
            e.end, e.why = ("timeout" if res.timed_out else "error"), str(err)


def _drop_failed_groups(eps: list[Episode], group: int) -> None:
    for g in range(0, len(eps), group):
        if any(e.end in FAULTS for e in eps[g:g + group]):
            for e in eps[g:g + group]:
                e.end = e.end if e.end in FAULTS else "dropped"


def reference(codec: TextCodec, prompt: Prompt, turns: list[dict], template_kwargs: dict, fmt: str = "") -> Sample:
    """A reference episode for --stage sft (a row's `episode` column: the messages after the
    prompt, assistant turns among them) under the token rule: each assistant turn is its text's ids
    and the stop id the template ends an assistant turn with (trained), each other message the ids
    `reply_ids` gives (context). An assistant turn with OpenAI-shaped `tool_calls` is the call text
    of the tools' format `fmt` (toolcalls.write_calls: exactly what the parser reads back)."""
    if not is_messages(turns) or not turns:
        raise ValueError("an `episode` is a list of {'role': str, 'content': str} messages, each turn's content "
                         f"its text: {str(turns)[:80]}")
    if turns[0].get("role") != "assistant":
        raise ValueError("an `episode` must start with an assistant turn (the prompt is the row's `prompt`)")
    completion, mask, stop, pending = [], [], end_of_turn(codec, template_kwargs), []
    for m in turns:
        if m.get("role") != "assistant":
            pending.append(m)
            continue
        if pending:  # the replies since the last assistant turn, as a played episode would have them
            ids = reply_ids(codec, pending, stop, template_kwargs)
            completion, mask, pending = completion + ids, mask + [False] * len(ids), []
        text = m["content"]
        if m.get("tool_calls"):
            if not fmt:
                raise ValueError("an assistant turn with `tool_calls` needs tools (--tool, or an environment's tools())")
            text = toolcalls.write_calls(fmt, m["tool_calls"], text)
        ids = codec.encode(text) + [stop]
        completion, mask = completion + ids, mask + [True] * len(ids)
    return Sample(prompt, completion, [0.0] * len(completion), [0] * len(completion), "stop", mask=mask)
