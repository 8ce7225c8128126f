"""Tools in episodes (agents/episodes.py with agents/toolcalls.py and agents/toolrun.py): the token rule with calls on
the Qwen3- and Llama-3.1-behaving tool templates of tests/test_toolcalls.py (two calls in one Qwen
turn; a Llama turn ending <|eom_id|>), the SFT round trip, a tool's faults inside an episode, the
start checks' lines, a run of the built-in `tools` and `calculator` environments, whole runs that
stop (past the abandoned-call limit; an environment whose tools() differ within a group), the
eval-set fit with an environment's schemas, and the calculator demonstration's models (their
starting directory against transformers, an episode on calc-tiny).

    python -m pytest -q tests/test_tools.py
"""

import json
import threading
from pathlib import Path

import pytest

import config as C
import data as D
from agents import envs
from agents import episodes as E
from run import hfdir
import model as M
import rollout
from run import start
from agents import toolcalls as T
from agents import toolschema as S
from agents import toolrun
import train
from engines.torch_engine import Sampling
from test_episodes import Scripted
from test_toolcalls import CALLS, LLAMA31_TOOLS, Faults, _model_dir, add, lookup
from tasks.textcodec import TextCodec

ROOT = Path(__file__).resolve().parent.parent
PROMPT = [{"role": "user", "content": "What is 1 + 2?"}]
FORMAT = {"qwen3": "hermes", "llama31": "llama3-json"}


def tools_model(tmp_path: Path, family: str = "qwen3", template: str | None = None) -> Path:
    """A random tiny model (1024 positions: the tool list alone is hundreds of characters) with the
    family's tool template and one-character tokenizer."""
    src = _model_dir(tmp_path, family)
    if template is not None:
        cfg = json.loads((src / "tokenizer_config.json").read_text())
        (src / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
    codec = TextCodec.load(src)
    m = M.Transformer(M.ModelArgs(codec.tok.get_vocab_size(), **{**M.TINY, "max_position_embeddings": 1024},
                                  eos_token_id=codec.stop_ids[0]))
    M.init_weights(m, seed=0)
    hfdir.save(m, tmp_path / f"{family}-model", src)
    return tmp_path / f"{family}-model"


def _play(codec, fmt, fns, turns, rows=1, per_turn=0, max_calls=8, timeout=5.0, env=envs.ToolsOnly):
    tools = S.toolset(fns)
    kwargs = {"tools": [t.schema for t in tools.values()]}
    row = D.Prompt(codec.render(PROMPT, **kwargs), PROMPT, {"answer": "3"})
    runner = toolrun.Runner(timeout, 40, codec.encode)
    spec = E.EnvSpec("tools", env, None, False, has_step=False)
    pl = E.Play(spec, codec, Scripted(turns, codec.stop_ids), Sampling(max_new_tokens=200), 4096, 3, 5.0, kwargs,
                tools=toolrun.Tools(tools, fmt, per_turn, max_calls, runner))
    return E.play(pl, [row] * rows, 1, [0] * rows), row, pl


def test_two_calls_in_one_qwen_turn_are_the_sampled_ids_then_the_templates_results(tmp_path):
    codec = TextCodec.load(_model_dir(tmp_path, "qwen3"))
    end = codec.tok.token_to_id("<|im_end|>")
    call = T.write_calls("hermes", [{"function": {"name": "add", "arguments": {"a": 1, "b": 2}}},
                                    {"function": {"name": "add", "arguments": {"a": 3, "b": 4}}}], "Two sums.")
    turns = [codec.encode(call) + [end], codec.encode("3 and 7") + [end]]
    (ep,), row, pl = _play(codec, "hermes", [add], [[turns[0]], [turns[1]]])
    after = ("\n<|im_start|>user\n<tool_response>\n3\n</tool_response>\n<tool_response>\n7\n</tool_response>"
             "<|im_end|>\n<|im_start|>assistant\n")  # by hand, from the format
    assert ep.ids == row.ids + turns[0] + codec.encode(after) + turns[1] and ep.end == "done"
    s = ep.sample()
    assert [i for i, m in zip(s.completion, s.mask) if m] == turns[0] + turns[1]
    assert ep.messages[1] == {"role": "assistant", "content": call, "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}},
        {"type": "function", "function": {"name": "add", "arguments": {"a": 3, "b": 4}}}]}
    assert ep.messages[2:] == [{"role": "tool", "name": "add", "content": "3"}, {"role": "tool", "name": "add", "content": "7"},
                               {"role": "assistant", "content": "3 and 7"}]
    m = rollout.episode_stats([ep], 3, pl)
    assert m["tools/calls"] == (2.0, 1.0) and m["tools/calls/add"] == (2.0, 1.0) and m["tools/turns_with_calls"] == (1.0, 2.0)
    assert m["tools/result_tokens"] == (float(len(codec.encode(after))), 1.0)


@pytest.mark.parametrize("stop", ["<|eom_id|>", "<|eot_id|>"])
def test_a_llama_call_ending_on_either_stop_is_followed_by_one_ipython_turn_and_no_second_end(tmp_path, stop):
    codec = TextCodec.load(_model_dir(tmp_path, "llama31"))
    sid, eot = codec.tok.token_to_id(stop), codec.tok.token_to_id("<|eot_id|>")
    call = "<|python_tag|>" + T.write_calls("llama3-json", CALLS[:1])
    turns = [codec.encode(call) + [sid], codec.encode("3") + [eot]]
    (ep,), row, _ = _play(codec, "llama3-json", [add], [[turns[0]], [turns[1]]])
    after = '<|start_header_id|>ipython<|end_header_id|>\n\n"3"<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n'
    assert ep.ids == row.ids + turns[0] + codec.encode(after) + turns[1] and ep.end == "done"
    assert ep.messages[1]["content"] == call and ep.messages[2] == {"role": "tool", "name": "add", "content": "3"}


def test_an_episode_that_ends_on_a_call_scores_no_answer(tmp_path, monkeypatch):
    """At the turn cap a call is not run (no turn would read it); `completions` is "" for the reward."""
    codec = TextCodec.load(_model_dir(tmp_path, "qwen3"))
    end = codec.tok.token_to_id("<|im_end|>")
    call = codec.encode(T.write_calls("hermes", CALLS[:1])) + [end]
    (ep,), _, pl = _play(codec, "hermes", [add], [[call]] * 3)
    assert ep.end == "max_turns" and ep.on_call and ep.n_turns == 3 and len(ep.calls) == 3
    seen = []
    monkeypatch.setattr(rollout, "score_groups", lambda fns, groups: [seen.append(g[1]) or [0.0] for g in groups])
    rollout.score_episodes(type("Task", (), {"codec": codec, "rewards": []})(), [ep], 1)
    assert seen == [[""]]


class Faulty(Faults):
    """Tools that fail on purpose (test_toolcalls.Faults: `gate` holds `hang`, no sleeps), and a long result."""

    def big(self) -> str:
        """A long result."""
        return "7" * 100

    def odd(self):
        """Not JSON."""
        return {1}


@pytest.mark.parametrize("family", ["qwen3", "llama31"])
def test_a_tools_faults_are_its_results_the_episodes_go_on_and_are_counted(tmp_path, family):
    codec = TextCodec.load(_model_dir(tmp_path, family))
    fmt, f = FORMAT[family], Faulty()
    stop = codec.stop_ids[0] if family == "qwen3" else codec.tok.token_to_id("<|eot_id|>")
    fns = [f.div, f.hang, f.big, f.odd]

    def turn(name, args):
        return codec.encode(T.write_calls(fmt, [{"function": {"name": name, "arguments": args}}])) + [stop]

    firsts = [turn("div", {"a": 1, "b": 0}), turn("hang", {}), turn("big", {}), turn("odd", {}), turn("nope", {}),
              turn("div", {"a": "1", "b": 2}), codec.encode('{"name": "div", "parameters": {"a": 1,' if fmt != "hermes"
                                                            else "<tool_call>\n{'name': 'div'}\n</tool_call>") + [stop]]
    try:
        eps, _, pl = _play(codec, fmt, fns, [firsts, [codec.encode("ok") + [stop]] * len(firsts)], rows=len(firsts), timeout=0.3)
    finally:
        f.gate.set()
    contents = [e.messages[2]["content"] for e in eps]
    assert contents[:6] == ["error: div raised ZeroDivisionError: division by zero", "error: hang timed out after 0.3 s",
                            "7" * 40 + "...[truncated 60 chars]",
                            "error: odd returned what cannot be its result: set is not str, int, float, bool, None, list or dict",
                            "error: no tool named 'nope' (tools: div, hang, big, odd)",
                            "error: div: argument 'a' must be integer, got \"1\""]
    assert contents[6].startswith("error: the tool call is not valid JSON")
    assert all(e.end == "done" and e.n_turns == 2 for e in eps)  # every episode went on; no group dropped
    m = rollout.episode_stats(eps, 3, pl)
    assert {k: m[f"tools/errors/{k}"][0] for k in T.KINDS} == {"parse": 1, "unknown": 1, "args": 1, "raised": 1,
                                                                "timeout": 1, "result": 1, "limit": 0}
    assert m["tools/truncated"] == (1.0, 7.0) and m["skipped/env_error"] == (0.0, 7.0) and "time/tools" in m


def _nested(a: int) -> list:
    """A list nested past Python's recursion limit.

    Args:
        a: unused
    """
    x = []
    for _ in range(100_000):
        x = [x]
    return x


class _Sly(str):
    def __len__(self):
        raise RuntimeError("no length")


def _sly(a: int) -> str:
    """A str whose length raises.

    Args:
        a: unused
    """
    return _Sly("1")


@pytest.mark.parametrize("fn,why", [(_nested, "maximum recursion depth"), (_sly, "no length")])
def test_a_result_that_fails_to_render_in_any_way_is_the_calls_error_not_the_runs(fn, why):
    """json.dumps of a deeply nested list raised RecursionError past the runner: a traceback, the run over."""
    codec = TextCodec.load(ROOT / "checkpoints" / "calc-tiny")
    call, tool = T.Call(fn.__name__, {"a": 1}), S.Tool(fn.__name__, fn, {})
    toolrun.Runner(5.0, 40, codec.encode).run([[call]], [{fn.__name__: tool}])
    assert call.kind == "result" and call.truncated == 0, (call.kind, call.content)
    assert call.content.startswith(f"error: {fn.__name__} returned what cannot be its result: ")
    assert why in call.content, call.content


def test_the_call_limits_answer_the_extra_calls_inside_an_episode(tmp_path):
    codec = TextCodec.load(_model_dir(tmp_path, "qwen3"))
    end = codec.tok.token_to_id("<|im_end|>")
    three = codec.encode(T.write_calls("hermes", [{"function": {"name": "add", "arguments": {"a": 1, "b": k}}}
                                                  for k in range(3)])) + [end]
    (ep,), _, pl = _play(codec, "hermes", [add], [[three], [three], [codec.encode("x") + [end]]], per_turn=2, max_calls=4)
    assert [(c.kind, c.content) for c in ep.calls] == [("", "1"), ("", "2"), ("limit", "error: at most 2 tool calls a turn"),
                                                       ("", "1"), ("limit", "error: tool call limit 4 reached"),
                                                       ("limit", "error: tool call limit 4 reached")]
    assert rollout.episode_stats([ep], 3, pl)["tools/errors/limit"] == (3.0, 6.0)


@pytest.mark.parametrize("family", ["qwen3", "llama31"])
def test_an_sft_reference_call_is_the_text_the_parser_reads_back_trained_as_model_tokens(tmp_path, family):
    codec = TextCodec.load(_model_dir(tmp_path, family))
    fmt, kwargs = FORMAT[family], {"tools": [S.schema(add)]}
    p = D.Prompt(codec.render(PROMPT, **kwargs), PROMPT, {})
    turns = [{"role": "assistant", "content": "", "tool_calls": CALLS[:1]}, {"role": "tool", "name": "add", "content": "3"},
             {"role": "assistant", "content": "3"}]
    s = E.reference(codec, p, turns, kwargs, fmt)
    end = E.end_of_turn(codec, kwargs)
    assert codec.tok.id_to_token(end) == ("<|im_end|>" if family == "qwen3" else "<|eot_id|>")  # not Llama's first stop id
    trained = [i for i, m in zip(s.completion, s.mask) if m]
    first = trained[:trained.index(end) + 1]
    text, stop = codec.decode_turn(first)
    assert [(c.name, c.arguments, c.kind) for c in T.parse(fmt, text, S.toolset([add]), stop)] == [("add", {"a": 1, "b": 2}, "")]
    assert s.completion == first + E.reply_ids(codec, turns[1:2], end, kwargs) + codec.encode("3") + [end]
    with pytest.raises(ValueError, match="needs tools"):
        E.reference(codec, p, turns, kwargs)


# ----------------------------------------------------------------------------- the start checks

def _rows(tmp_path: Path, string: bool = False) -> Path:
    f = tmp_path / "rows.jsonl"
    rows = [{"prompt": f"{k}+1=" if string else [{"role": "user", "content": f"{k}+1="}], "answer": str(k + 1)}
            for k in range(20)]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f


def _tool_file(tmp_path: Path, body: str) -> Path:
    f = tmp_path / "mytools.py"
    f.write_text(body)
    return f


def _refused(capsys, tmp_path, args) -> str:
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        train.main([*args, "--steps", "1", "--eval-every", "0", "--out-dir", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and not out.exists(), err
    return err[0].removeprefix("floe: error: ")


NO_HINT = '''
def f(a, b: int) -> int:
    """F.

    Args:
        a: a
        b: b
    """
    return 0


def add(a: int, b: int) -> int:
    """Another add.

    Args:
        a: a
        b: b
    """
    return a - b


def bare(a, b):
    return a


def hint(x: int) -> int:
    """Named like a method of GuessLetter.

    Args:
        x: x
    """
    return x
'''
NO_FORMAT = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}"
NEEDS_CALL = LLAMA31_TOOLS.replace("{%- elif m.role == 'tool' or m.role == 'ipython' -%}",
                                   "{%- elif m.role == 'tool' and not loop.previtem.tool_calls -%}{{- raise_exception('a result needs its call') -}}"
                                   "{%- elif m.role == 'tool' or m.role == 'ipython' -%}")


def test_what_tools_cannot_run_with_is_refused_in_one_line_before_the_first_byte(tmp_path, capsys):
    rows, qwen = _rows(tmp_path), tools_model(tmp_path)
    for d in ("s", "n", "g"):
        (tmp_path / d).mkdir()
    strings, no_format = _rows(tmp_path / "s", string=True), tools_model(tmp_path / "n", template=NO_FORMAT)
    needs_call, llama = tools_model(tmp_path / "g", "llama31", NEEDS_CALL), tools_model(tmp_path, "llama31")
    tool = ["--tool", "examples/calculator.py:add", "--reward", "numeric_match"]
    base = ["--task", f"jsonl:{rows}", "--model", str(qwen), "--eval-prompts", "4"]
    f = _tool_file(tmp_path, NO_HINT)
    cases = [
        (["--tool", "nowhere.py:add", "--reward", "numeric_match"], "--tool nowhere.py:add: no such file nowhere.py"),
        (["--tool", "agents.envs:PROMPT", "--reward", "numeric_match"], "--tool agents.envs:PROMPT: 'guess a letter from a to o' is not a function"),
        (["--tool", f"{f}:f", "--reward", "numeric_match"], "tool f: parameter a: no type hint"),
        (tool + ["--tool", "examples/calculator.py:add"], "--tool examples/calculator.py:add is given twice; give each tool once"),
        (tool + ["--tool", f"{f}:add"], f"--tool examples/calculator.py:add and --tool {f}:add are both named 'add': a "
                                        "call names a tool by its function's name, so each needs its own"),
        (["--tool", f"{f}:bare", "--reward", "numeric_match"], "tool bare: no docstring and no type hint on a, b"),
        (["--tool", "examples/calculator.py:add"], "needs --reward"),
        (tool + ["--chat-template-kwargs", '{"tools": []}'], "--chat-template-kwargs sets `tools`"),
        (tool + ["--task", f"jsonl:{strings}"], "a string prompt cannot show the tools"),
        (["--tool", "examples/calculator.py:add", "--env", "guess-letter", "--model", "checkpoints/guess-tiny", "--task",
          "jsonl:examples/guess.jsonl"], "tokenizer_config.json ignores `tools` (it renders the same text with and without"),
        (tool + ["--model", str(no_format)], "--tool-format auto: chat template"),
        (tool + ["--model", str(needs_call)], "cannot render a tool result after a plain assistant turn"),
        (tool + ["--model", str(llama), "--max-tool-calls-per-turn", "2"],
         "--max-tool-calls-per-turn 2 with llama3-json"),
        (["--tool", f"{f}:hint", "--env", "guess-letter", "--task", "jsonl:examples/guess.jsonl"],
         "--tool hint: named like --env guess-letter's GuessLetter.hint; rename the tool"),
        (tool + ["--max-tool-calls", "0"], "--max-tool-calls must be >= 1, got 0"),
        (tool + ["--tool-timeout", "0"], "--tool-timeout must be a finite number of seconds > 0, got 0.0"),
        (tool + ["--max-tool-result-chars", "0"], "--max-tool-result-chars must be >= 1, got 0"),
    ]
    for extra, words in cases:
        line = _refused(capsys, tmp_path, [*base, *extra])
        assert words in line, (extra, line)


@pytest.mark.parametrize("held", [3, 5, 7, 15])
def test_a_string_prompt_is_named_by_its_first_line_in_the_file(tmp_path, capsys, held):
    """Every row a string: the line named is line 1 whichever rows --eval-prompts holds out (the
    held-out rows are a random draw from all over the file, the rest train)."""
    rows, model = _rows(tmp_path, string=True), tools_model(tmp_path)
    line = _refused(capsys, tmp_path, ["--task", f"jsonl:{rows}", "--model", str(model), "--eval-prompts", str(held),
                                       "--tool", "examples/calculator.py:add", "--reward", "numeric_match"])
    assert line == f"{rows}:1: a string prompt cannot show the tools (the chat template does); give the prompt as chat messages"


def test_the_tools_environment_and_the_calculator_train_with_their_metrics(tmp_path):
    """--tool without --env on a random tiny Qwen3-shaped model, and --env calculator (the same
    schema): the runs train, log the tool metrics, and an eval reports the calls."""
    model, rows = tools_model(tmp_path), _rows(tmp_path)
    flags = ["--task", f"jsonl:{rows}", "--model", str(model), "--steps", "1", "--prompts-per-step", "2",
             "--group-size", "2", "--max-new-tokens", "4", "--max-turns", "2", "--eval-prompts", "2", "--reward", "numeric_match"]
    for extra, name in [(["--tool", "examples/calculator.py:add", "--eval-every", "0"], "tools"),
                        (["--env", "calculator", "--eval-every", "1"], "calculator")]:
        out = tmp_path / name
        train.main([*flags, *extra, "--out-dir", str(out)])
        last = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][-1]
        keys = ("tools/calls", "tools/turns_with_calls", "tools/result_tokens", "tools/abandoned", "time/tools", "episode/turns")
        for k in keys + (("eval/tool_calls", "eval/tool_errors") if name == "calculator" else ()):
            assert k in last, (name, k)
    assert envs.CalculatorOff().add(1, 2) == "error: the calculator is off" and envs.Calculator().add(1, 2) == 3
    assert S.schema(envs.CalculatorOff().add) == S.schema(S.load(("examples/calculator.py:add",))[0])


# ----------------------------------------------------------------------------- whole runs that stop

GATE = threading.Event()  # holds HANG's tool until the test ends (no sleeps)
HANG = '''
import test_tools


def hang(x: int) -> int:
    """Wait for the test's gate.

    Args:
        x: anything
    """
    test_tools.GATE.wait()
    return x
'''


def test_more_than_the_abandoned_limit_stop_the_run_in_one_line_naming_the_tool(tmp_path, capsys, monkeypatch):
    """Every episode calls a tool that never returns (the engine samples the call: a random model
    would not); past toolrun.MAX_ABANDONED (256, lowered here so that one step reaches it) calls still
    alive, the run stops with its line, exit 1."""
    from engines.torch_engine import Completion, TorchEngine

    assert toolrun.MAX_ABANDONED == 256
    monkeypatch.setattr(toolrun, "MAX_ABANDONED", 5)
    model, rows, f = tools_model(tmp_path), _rows(tmp_path), tmp_path / "hangs.py"
    f.write_text(HANG)
    codec = TextCodec.load(model)
    call = codec.encode(T.write_calls("hermes", [{"function": {"name": "hang", "arguments": {"x": 1}}}])) + [codec.stop_ids[0]]

    def generate(self, prompts, n, sampling, budgets=None, keep=True):
        return [Completion(list(call), [-0.5] * len(call), [self.version] * len(call), "stop") for _ in range(len(prompts) * n)]

    monkeypatch.setattr(TorchEngine, "generate", generate)
    out = tmp_path / "run"
    try:
        with pytest.raises(SystemExit) as e:
            train.main(["--task", f"jsonl:{rows}", "--model", str(model), "--tool", f"{f}:hang", "--reward", "numeric_match",
                        "--steps", "2", "--prompts-per-step", "2", "--group-size", "3", "--max-turns", "3",
                        "--eval-every", "0", "--tool-timeout", "0.05", "--eval-prompts", "2", "--out-dir", str(out)])
    finally:
        GATE.set()
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 1 and len(err) == 1, err
    assert err[0] == ("floe: error: 6 timed-out tool calls are still running (6 of them calls of hang): make hang return, "
                      "or give it longer with --tool-timeout (now 0.05 s)")


DRIFTING = '''
import itertools


class Drifting:
    """Each new episode declares the tool under another name: a group's episodes differ."""

    count = itertools.count()

    def reset(self, row, seed):
        self.k = next(self.count)

    def tools(self):
        return [self.add if self.k % 2 else self.plus]

    def add(self, a: int) -> int:
        """Add one.

        Args:
            a: the number
        """
        return a + 1

    def plus(self, a: int) -> int:
        """Add one.

        Args:
            a: the number
        """
        return a + 1
'''


def test_an_environment_whose_tools_differ_for_one_row_and_seed_is_refused_in_its_own_line(tmp_path, capsys):
    model, rows, f = tools_model(tmp_path), _rows(tmp_path), tmp_path / "drifting.py"
    f.write_text(DRIFTING)
    with pytest.raises(SystemExit) as e:
        train.main(["--task", f"jsonl:{rows}", "--model", str(model), "--env", f"{f}:Drifting", "--reward", "numeric_match",
                    "--steps", "1", "--prompts-per-step", "2", "--group-size", "2", "--eval-every", "0",
                    "--eval-prompts", "2", "--out-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 1 and len(err) == 1, err
    assert err[0] == (f"floe: error: --env {f}:Drifting: tools() gave different tools for one row and seed; they must "
                      "depend on (row, seed) alone (their schemas are part of the group's first prompt)")


# ----------------------------------------------------------------------------- the eval-set fit

WIDE = '''
def _named(fn, name):
    def f(self, a: int, b: int) -> int:
        return fn(self, a, b)
    f.__name__, f.__doc__ = name, fn.__doc__
    return f


class Wide:
    """A row marked `wide` gets eight tools: their schemas alone outgrow the tiny model's context."""

    columns = ("wide",)

    def reset(self, row, seed):
        self.wide = row["wide"]

    def tools(self):
        return [self.add] + ([getattr(self, f"add{k}") for k in range(7)] if self.wide else [])

    def add(self, a: int, b: int) -> int:
        """Add two integers and say nothing else about them at all, for this is a long line.

        Args:
            a: the first integer, which may be any integer that Python holds
            b: the second integer, which may be any integer that Python holds
        """
        return a + b

    add0, add1, add2, add3, add4, add5, add6 = map(_named, [add] * 7, [f"add{k}" for k in range(7)])
'''


def test_the_eval_set_fit_sees_an_environments_tool_schemas(tmp_path, capsys):
    """The held-out rows' ids hold no schemas of an environment's tools() (they exist after reset);
    the fit renders each first prompt as the eval will, so the wide rows are left out at the start
    (the eval would otherwise play them as episodes with no room for a turn, scored as lost), and with
    every row wide the run is refused in one line."""
    model, f = tools_model(tmp_path), tmp_path / "wide.py"
    f.write_text(WIDE)
    codec, rows, held = TextCodec.load(model), tmp_path / "rows.jsonl", tmp_path / "held.jsonl"
    one = [{"role": "user", "content": "0+1="}]
    narrow, wide = (len(codec.render(one, tools=[S.schema(add)] * k)) for k in (1, 8))  # the schemas' text, as the template puts it
    assert narrow + 4 <= 1024 < wide + 4

    def write(path, flags):
        path.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"{k}+1="}], "answer": str(k + 1),
                                            "wide": w}) + "\n" for k, w in enumerate(flags)))

    write(rows, [False] * 8)
    args = ["--task", f"jsonl:{rows}", "--model", str(model), "--env", f"{f}:Wide", "--reward", "numeric_match",
            "--eval-file", str(held), "--eval-prompts", "4", "--steps", "1", "--prompts-per-step", "2",
            "--group-size", "2", "--max-new-tokens", "4", "--max-turns", "1"]
    write(held, [False, True, False, True])
    begun = start.check_start(start.settled(C.parse([*args, "--out-dir", str(tmp_path / "some")]).resolve(False)))
    out = capsys.readouterr().out
    assert "warning: 2 of 4 held-out prompts do not fit the context (1024 tokens, --max-new-tokens 4)" in out, out
    assert [p.columns["wide"] for p in begun.task.eval_set] == [False, False]  # what rollout.evaluate_episodes plays
    write(held, [True] * 4)
    with pytest.raises(SystemExit) as e:
        train.main([*args, "--out-dir", str(tmp_path / "all")])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and not (tmp_path / "all").exists(), err
    assert err[0] == ("floe: error: no held-out prompt fits the context (1024 tokens with --max-new-tokens 4); lower "
                      "--max-new-tokens or use --eval-every 0")


def test_the_overlap_bench_runs_every_call_and_reports_time_tools(capsys):
    """bench/tool_overlap.py on a tiny step (its figure is docs/experiments.md's; the overlap itself is
    test_toolcalls' barrier test, which cannot flake): every call runs and returns, and a row is printed."""
    from conftest import bench_module

    bench_module("tool_overlap").main(["--groups", "2", "--group-size", "2", "--turns", "2", "--ms", "1"])
    rows = [x for x in capsys.readouterr().out.splitlines() if x.startswith(("| wait", "| spin"))]
    assert [r.split(" | ")[:2] for r in rows] == [["| wait", "8"], ["| spin", "8"]]


# ----------------------------------------------------------------------------- the calculator demonstration

def test_the_calculator_starting_directory_renders_tools_as_transformers_does(tmp_path):
    """`python bench/tools.py scratch DIR` (calc-tiny's and direct-tiny's start): floe loads it, the four
    hermes tags are single ids, and floe's text equals transformers' apply_chat_template with tools, for a
    first prompt with and without them and for histories of calls and merged results. The shipped
    checkpoints carry the same tokenizer and template."""
    from conftest import bench_module

    d = tmp_path / "calc"
    bench_module("tools").scratch(str(d))
    model, codec = hfdir.load(d), TextCodec.load(d)
    assert sum(p.numel() for p in model.parameters()) <= 1_000_000
    assert all(len(codec.encode(t)) == 1 for t in ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"))
    assert T.detect_format(codec.template) == "hermes"
    hf = pytest.importorskip("transformers").AutoTokenizer.from_pretrained(d)
    row = envs.Calculator.rows(1, 0)[0]
    two = [{"role": "assistant", "content": "Two.", "tool_calls": CALLS},
           {"role": "tool", "name": "add", "content": "3"}, {"role": "tool", "name": "lookup", "content": '{"t": 21}'}]
    system = [{"role": "system", "content": "Be exact."}]
    for messages, fns in [(row["prompt"], None), (row["prompt"], [add]), (row["prompt"] + row["episode"], [add]),
                          (system + row["prompt"] + two, [add, lookup]), (system + row["prompt"], None)]:
        kwargs = {"tools": [S.schema(f) for f in fns]} if fns else {}
        text = hf.apply_chat_template(messages, tools=fns, tokenize=False, add_generation_prompt=True)
        assert codec.render_text(messages, True, **kwargs) == text
        assert codec.render(messages, **kwargs) == hf.encode(text, add_special_tokens=False)
        assert ("tools: add(a, b)" in text) == bool(fns)
    merged = codec.render_text(row["prompt"] + two, False, tools=[S.schema(add), S.schema(lookup)])
    assert "<|im_start|>user\n<tool_response>\n3\n</tool_response>\n<tool_response>\n{\"t\": 21}\n</tool_response><|im_end|>" in merged
    for name in ("calc-tiny", "direct-tiny"):
        for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            assert (ROOT / "checkpoints" / name / f).read_bytes() == (d / f).read_bytes(), (name, f)


def test_a_calculator_episode_on_calc_tiny_calls_add_and_answers():
    """checkpoints/calc-tiny plays `--env calculator` with the built-in engine: its first turns parse as
    calls of `add`, the environment's add answers each with the sum of the arguments it parsed, and
    episodes end on an answer turn."""
    from engines.torch_engine import TorchEngine

    d = ROOT / "checkpoints" / "calc-tiny"
    codec = TextCodec.load(d)
    rows = envs.Calculator.rows(4, 1)
    kwargs = {"tools": [S.schema(envs.Calculator().add)]}
    prompts = [D.Prompt(codec.render(r["prompt"], **kwargs), r["prompt"], r) for r in rows]
    tools = toolrun.Tools({}, "hermes", 0, 8, toolrun.Runner(5.0, 2000, codec.encode), env_tools=True)
    spec = E.EnvSpec("calculator", envs.Calculator, None, False, has_step=False, has_tools=True)
    engine = TorchEngine(hfdir.load(d), "fp32", codec.stop_ids, seed=0)
    pl = E.Play(spec, codec, engine, Sampling(max_new_tokens=64), 512, 3, 5.0, kwargs, tools=tools)
    eps = E.play(pl, prompts, 2, [0] * len(rows))
    calls = [c for e in eps for c in e.calls]
    assert calls and all(c.name == "add" for c in calls)
    good = [(e, c) for e in eps for c in e.calls if not c.kind]
    assert good, [c.content for c in calls]  # well-formed calls, run by the environment's add
    assert all(c.content == str(c.arguments["a"] + c.arguments["b"]) for _, c in good)
    assert all(e.call_turns >= 1 for e in eps) and any(e.end == "done" and not e.on_call for e in eps)


def test_sft_with_an_environment_that_declares_tools_is_refused_in_one_line(tmp_path, capsys):
    """--stage sft renders the task's prompts (no reset), so an environment's tools() would be missing
    from every reference's prompt while the eval's episodes show them: refused before anything is
    written, pointing at --tool."""
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        train.main(["--stage", "sft", "--task", f"jsonl:{ROOT / 'examples' / 'calc.jsonl'}", "--env", "calculator",
                    "--reward", "numeric_match", "--model", str(ROOT / "checkpoints" / "calc-tiny"), "--steps", "1",
                    "--out-dir", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and not out.exists(), err
    assert err[0].startswith("floe: error: --env calculator: Calculator.tools() reach an episode's prompt after reset")
    assert err[0].endswith("give the same tools with --tool for the warm-up")
