"""agents/toolschema.py's schemas against transformers' get_json_schema; agents/toolcalls.py: both call
formats parsed (each malformed kind with its error line), written calls read back, results rendered
by Qwen3- and Llama-3.1-behaving templates as transformers renders them; and the runner's faults injected.

The two templates below are written here from the formats' public descriptions, not copied from
either project: Qwen3 puts a `# Tools` block in the system turn with one `tojson` schema a line
inside <tools>, writes a call as `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`
after the turn's text, and merges consecutive results into one user turn of <tool_response>
blocks; Llama 3.1 adds `Environment: ipython` to the system header, puts each tool
(`tojson(indent=4)`) in the first user message, writes a call as the whole turn
`{"name": ..., "parameters": ...}` (one a turn), and a result as an `ipython` turn whose content
goes through `tojson` when it is iterable (a string too: `42` becomes `"42"`).
"""

import asyncio
import json
import threading
from typing import Any, Literal

import pytest
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from tasks import textcodec as D
from tasks import task
from agents import toolcalls as T
from agents import toolschema as S
from agents import toolrun as R

QWEN3_TOOLS = r"""
{%- set first = 1 if messages[0].role == 'system' else 0 -%}
{%- if tools -%}
  {{- '<|im_start|>system\n' + (messages[0].content + '\n\n' if first else '') -}}
  {{- '# Tools\n\nFunctions you may call, one signature a line:\n<tools>' -}}
  {%- for t in tools -%}{{- '\n' + (t | tojson) -}}{%- endfor -%}
  {{- '\n</tools>\n\nCall one as <tool_call>\n{"name": <name>, "arguments": <object>}\n</tool_call><|im_end|>\n' -}}
{%- elif first -%}
  {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' -}}
{%- endif -%}
{%- set ns = namespace(last_user=-1) -%}
{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}{%- endfor -%}
{%- for m in messages[first:] -%}
  {%- set i = loop.index0 + first -%}
  {%- if m.role == 'assistant' -%}
    {%- set text = m.content or '' -%}
    {%- if i < ns.last_user and '</think>' in text -%}{%- set text = text.split('</think>')[-1].lstrip('\n') -%}{%- endif -%}
    {{- '<|im_start|>assistant\n' + text -}}
    {%- for tc in m.tool_calls or [] -%}
      {%- set f = tc.function if tc.function is defined else tc -%}
      {%- if not loop.first or text -%}{{- '\n' -}}{%- endif -%}
      {{- '<tool_call>\n{"name": "' + f.name + '", "arguments": ' -}}
      {{- f.arguments if f.arguments is string else f.arguments | tojson -}}
      {{- '}\n</tool_call>' -}}
    {%- endfor -%}
    {{- '<|im_end|>\n' -}}
  {%- elif m.role == 'tool' -%}
    {%- if i == first or messages[i - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
    {{- '\n<tool_response>\n' + m.content + '\n</tool_response>' -}}
    {%- if loop.last or messages[i + 1].role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
  {%- else -%}
    {{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
  {{- '<|im_start|>assistant\n' -}}
  {%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\n\n</think>\n\n' -}}{%- endif -%}
{%- endif -%}
"""

LLAMA31_TOOLS = r"""
{{- bos_token -}}
{%- set tools = tools if tools is defined else none -%}
{%- if messages[0].role == 'system' -%}{%- set sys = messages[0].content | trim -%}{%- set rest = messages[1:] -%}
{%- else -%}{%- set sys = '' -%}{%- set rest = messages -%}{%- endif -%}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' -}}
{%- if tools is not none -%}{{- 'Environment: ipython\n' -}}{%- endif -%}
{{- 'Cutting Knowledge Date: December 2023\n\n' + sys + '<|eot_id|>' -}}
{%- if tools is not none -%}
  {%- if not rest or rest[0].role != 'user' -%}{{- raise_exception('the tools go in the first user message') -}}{%- endif -%}
  {{- '<|start_header_id|>user<|end_header_id|>\n\nAnswer with a JSON call {"name": ..., "parameters": ...} of one of:\n\n' -}}
  {%- for t in tools -%}{{- (t | tojson(indent=4)) + '\n\n' -}}{%- endfor -%}
  {{- (rest[0].content | trim) + '<|eot_id|>' -}}
  {%- set rest = rest[1:] -%}
{%- endif -%}
{%- for m in rest -%}
  {%- if m.role == 'assistant' and m.tool_calls -%}
    {%- if m.tool_calls | length != 1 -%}{{- raise_exception('one tool call a turn') -}}{%- endif -%}
    {%- set tc = m.tool_calls[0] -%}{%- set f = tc.function if tc.function is defined else tc -%}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "' + f.name + '", "parameters": ' -}}
    {{- (f.arguments | tojson) + '}<|eot_id|>' -}}
  {%- elif m.role == 'tool' or m.role == 'ipython' -%}
    {{- '<|start_header_id|>ipython<|end_header_id|>\n\n' -}}
    {%- if m.content is mapping or m.content is iterable -%}{{- m.content | tojson -}}{%- else -%}{{- m.content -}}{%- endif -%}
    {{- '<|eot_id|>' -}}
  {%- else -%}
    {{- '<|start_header_id|>' + m.role + '<|end_header_id|>\n\n' + (m.content | trim) + '<|eot_id|>' -}}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}{%- endif -%}
"""

QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN_TOOL_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
LLAMA_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                  "<|python_tag|>", "<|end_of_text|>"]
FAMILIES = {  # specials, tokens added but not special (as Qwen3's tool tokens are), template, eos, bos, stops
    "qwen3": (QWEN_SPECIALS + QWEN_TOOL_TOKENS, [], QWEN3_TOOLS, "<|im_end|>", None, [2, 0]),
    "qwen3-nonspecial": (QWEN_SPECIALS, QWEN_TOOL_TOKENS, QWEN3_TOOLS, "<|im_end|>", None, [2, 0]),
    "llama31": (LLAMA_SPECIALS, [], LLAMA31_TOOLS, "<|eot_id|>", "<|begin_of_text|>", [6, 4, 3]),
}
FORMAT = {"qwen3": "hermes", "qwen3-nonspecial": "hermes", "llama31": "llama3-json"}


def _tokenizer(specials: list[str], plain: list[str]) -> Tokenizer:
    """One id per printable character, and one per family token (`plain` ones not marked special)."""
    vocab = {t: i for i, t in enumerate(specials + plain + list(dict.fromkeys(task.PRINTABLE)))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=specials[0]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tok.add_tokens([AddedToken(s, special=False, normalized=False) for s in plain])
    return tok


def _model_dir(tmp_path, family: str):
    specials, plain, template, eos, bos, stops = FAMILIES[family]
    d = tmp_path / family
    d.mkdir()
    _tokenizer(specials, plain).save(str(d / "tokenizer.json"))
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "unk_token": specials[0],
           "bos_token": bos, "chat_template": template}
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": stops}))
    return d


# ----------------------------------------------------------------------------- tools used below

def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second

    Returns:
        Their sum.
    """
    return a + b


def lookup(city: str, unit: str = "c", days: list[int] | None = None) -> dict:
    """Look up the weather.

    Args:
        city: the city's name
        unit: the unit (choices: ["c", "f"])
        days: the days ahead,
            counted from today
    """
    return {"city": city, "unit": unit, "days": days}


def s_any(x: Any, y: float = 1.5) -> str:
    """Anything.

    Args:
        x: any value
        y: a number
    """
    return str(x)


def s_nested(m: dict[str, list[int]], flags: list[bool], note: str | None = None) -> None:
    """Nested types.

    Args:
        m: lists by key
        flags: some flags
        note: an optional note
    """


def s_union(v: int | str, w: list[dict[str, float]] | str, k: str = "a"):
    """Unions and choices.

    Args:
        v: a number or a name
        w: rows or a name
        k: a choice (choices: [" a", "b"])
    """


def s_bare(items: list, table: dict, when: float | None) -> list[str]:
    """Bare containers.

    A second paragraph.

    Args:
        items: anything in a list
        table: any object
        when: a time, or null

    Returns:
        The names,
        one per item.
    """


def s_kwonly(*, key: str, n: int = 3) -> bool:
    """Keyword-only.

    Args:
        key: a key
        n: how many (choices: [1, 2, 3])
    """


def s_none() -> str:
    """No arguments at all."""
    return "ok"


async def s_async(q: str) -> str:
    """An async tool.

    Args:
        q: the question
    """
    await asyncio.sleep(0)
    return q.upper()


class Counter:
    def bump(self, by: int = 1) -> int:
        """Bump the counter.

        Args:
            by: the step
        """
        self.n = getattr(self, "n", 0) + by
        return self.n


SIGNATURES = [add, lookup, s_any, s_nested, s_union, s_bare, s_kwonly, s_none, s_async, Counter().bump]


@pytest.mark.parametrize("fn", SIGNATURES, ids=lambda f: f.__name__)
def test_the_schema_equals_get_json_schema_key_for_key_and_in_order(fn):
    from transformers.utils import get_json_schema

    assert json.dumps(S.schema(fn)) == json.dumps(get_json_schema(fn))


def _no_hint(a, b: int):
    """X.

    Args:
        a: a
        b: b
    """


def _no_line(a: int, b: int):
    """X.

    Args:
        a: a
    """


def _custom(a: int, when: threading.Event):
    """X.

    Args:
        a: a
        when: w
    """


def _star(a: int, *rest: int):
    """X.

    Args:
        a: a
        rest: r
    """


def _kw(a: int, **more: int):
    """X.

    Args:
        a: a
        more: m
    """


def _int_keys(m: dict[int, str]):
    """X.

    Args:
        m: m
    """


def _literal(k: Literal["a", "b"]):
    """X.

    Args:
        k: k
    """


def _tuple(t: tuple[int, int]):
    """A tuple arrives as a JSON list, not a tuple.

    Args:
        t: t
    """


def _bad_choices(k: str):
    """X.

    Args:
        k: k (choices: a, b)
    """


def _undocumented(a: int):
    return a


def _bare(a, b, c: int):
    return a


def _neither(a, b: int):
    """Neither a hint nor an Args: line for a.

    Args:
        b: b
    """


@pytest.mark.parametrize("fn,line", [
    (_no_hint, "tool _no_hint: parameter a: no type hint"),
    (_no_line, "tool _no_line: parameter b: no line in the docstring's Args: block"),
    (_custom, "tool _custom: parameter when: type Event has no JSON schema (int, float, str, bool, Any, list[T], "
              "dict[str, V], X | None)"),
    (_int_keys, "tool _int_keys: parameter m: type dict[int, str] has no JSON schema (int, float, str, bool, Any, "
                "list[T], dict[str, V], X | None)"),
    (_literal, "tool _literal: parameter k: type Literal['a', 'b'] has no JSON schema (int, float, str, bool, Any, "
               "list[T], dict[str, V], X | None)"),
    (_tuple, "tool _tuple: parameter t: type tuple[int, int] has no JSON schema (int, float, str, bool, Any, "
             "list[T], dict[str, V], X | None)"),
    (_bad_choices, "tool _bad_choices: parameter k: (choices: a, b) is not a JSON list"),
    (_star, "tool _star: parameter rest: *args and **kwargs have no JSON schema; name each parameter"),
    (_kw, "tool _kw: parameter more: *args and **kwargs have no JSON schema; name each parameter"),
    (_undocumented, "tool _undocumented: no docstring (it needs a docstring with an Args: line per parameter)"),
    (_bare, "tool _bare: no docstring and no type hint on a, b (it needs a docstring with an Args: line per "
            "parameter, and a type hint on each)"),
    (_neither, "tool _neither: parameter a: no type hint and no line in the docstring's Args: block"),
])
def test_what_a_schema_cannot_describe_is_refused_in_one_line_naming_the_parameter(fn, line):
    with pytest.raises(ValueError) as e:
        S.schema(fn)
    assert str(e.value) == line


def test_two_tools_of_one_name_are_refused():
    def other():
        """Another."""

    other.__name__ = "add"
    assert list(S.toolset([add, lookup])) == ["add", "lookup"]
    with pytest.raises(ValueError) as e:  # named where each is defined, never by a memory address
        S.toolset([add, other])
    assert str(e.value) == (f"tests/test_toolcalls.py:add and tests/test_toolcalls.py:{other.__qualname__} are both "
                            "named 'add': a call names a tool by its function's name, so each needs its own")
    with pytest.raises(ValueError) as e:
        S.toolset([add, lookup, add], ["--tool a.py:add", "--tool a.py:lookup", "--tool a.py:add"])
    assert str(e.value) == "--tool a.py:add is given twice; give each tool once"
    assert S.origin(add) == "tests/test_toolcalls.py:add" and S.origin(json.dumps).endswith("json/__init__.py:dumps")


def test_the_format_comes_from_the_template():
    assert T.detect_format(QWEN3_TOOLS) == "hermes" and T.detect_format(LLAMA31_TOOLS) == "llama3-json"
    assert T.detect_format("{{ '<|python_tag|>' }}") == "llama3-json" and T.detect_format(D.CHATML) is None


# ----------------------------------------------------------------------------- parsing

TOOLS = S.toolset([add, lookup, s_none])


def _calls(fmt, text, **kw):
    return [(c.name, c.arguments, c.kind, c.content) for c in T.parse(fmt, text, TOOLS, **kw)]


def test_hermes_reads_every_call_outside_the_thinking_in_order():
    text = ('<think>\nmaybe <tool_call>\n{"name": "add", "arguments": {"a": 9, "b": 9}}\n</tool_call>\n</think>\n\n'
            'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
            '<tool_call>{"name": "lookup", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call>\n'
            '<tool_call>\n{"name": "s_none"}\n</tool_call>')
    assert _calls("hermes", text, stop="<|im_end|>") == [
        ("add", {"a": 1, "b": 2}, "", ""), ("lookup", {"city": "Oslo"}, "", ""), ("s_none", {}, "", "")]
    assert _calls("hermes", text + "<|im_end|>", stop="<|im_end|>") == _calls("hermes", text)


@pytest.mark.parametrize("text", [
    "the answer is 3",
    '<think>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n</think>\n\n3',
    'reasoning <tool_call>{"name": "add"}</tool_call></think>\n\n3',  # the generation prompt opened the thinking
    '<think>\nstill thinking <tool_call>{"name": "add"',  # thinking that never closed
    '{"name": "add", "arguments": {"a": 1, "b": 2}}',  # a llama call is an answer to hermes
])
def test_a_hermes_turn_without_a_call_outside_the_thinking_is_an_answer(text):
    assert T.parse("hermes", text, TOOLS) == []


@pytest.mark.parametrize("block,kind,line", [
    ("{'name': 'add'}", "parse", "error: the tool call is not valid JSON (Expecting property name enclosed in double "
                                 "quotes: line 1 column 2 (char 1))"),
    ('["add", 1]', "parse", 'error: a tool call is a JSON object, got ["add", 1]'),
    ('{"arguments": {"a": 1}}', "parse", 'error: a tool call needs a "name" string'),
    ('{"name": "add", "arguments": [1, 2]}', "parse", 'error: the "arguments" of a call of add must be a JSON object'),
    ('{"name": "add", "arguments": "a=1"}', "parse", 'error: the "arguments" of a call of add must be a JSON object'),
    ('{"name": "sub", "arguments": {}}', "unknown", "error: no tool named 'sub' (tools: add, lookup, s_none)"),
    ('{"name": "add", "arguments": {"a": 1}}', "args", "error: add is missing the argument 'b'"),
    ('{"name": "add", "arguments": {"a": 1, "b": 2, "c": 3}}', "args", "error: add has no argument 'c' (it takes a, b)"),
    ('{"name": "add", "arguments": {"a": 1, "b": "2"}}', "args", "error: add: argument 'b' must be integer, got \"2\""),
    ('{"name": "add", "arguments": {"a": 1.5, "b": 2}}', "args", "error: add: argument 'a' must be integer, got 1.5"),
    ('{"name": "add", "arguments": {"a": true, "b": 2}}', "args", "error: add: argument 'a' must be integer, got true"),
    ('{"name": "lookup", "arguments": {"city": "x", "unit": "k"}}', "args",
     "error: lookup: argument 'unit' must be one of [\"c\", \"f\"], got \"k\""),
    ('{"name": "lookup", "arguments": {"city": "x", "days": [1, "2"]}}', "args",
     "error: lookup: argument 'days' must be array of integer or null, got [1, \"2\"]"),
])
def test_each_malformed_hermes_call_is_answered_with_its_line_and_kind(block, kind, line):
    text = f"first <tool_call>\n{{\"name\": \"s_none\", \"arguments\": {{}}}}\n</tool_call>\n<tool_call>\n{block}\n</tool_call>"
    good, bad = T.parse("hermes", text, TOOLS)
    assert good.kind == "" and (bad.kind, bad.content) == (kind, line)
    assert line.isascii() and len(line) <= 200 and "\n" not in line


def test_a_null_for_a_nullable_argument_and_an_unclosed_call():
    assert _calls("hermes", '<tool_call>{"name": "lookup", "arguments": {"city": "x", "days": null}}</tool_call>') == [
        ("lookup", {"city": "x", "days": None}, "", "")]
    assert _calls("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}') == [
        ("", {}, "parse", "error: <tool_call> without </tool_call>")]


@pytest.mark.parametrize("tag", ["", "<|python_tag|>", "<|python_tag|>\n "])
@pytest.mark.parametrize("stop", ["<|eot_id|>", "<|eom_id|>"])
def test_llama_reads_the_whole_turn_as_one_call_with_or_without_the_python_tag(tag, stop):
    for body in ['{"name": "add", "parameters": {"a": 1, "b": 2}}', '{"type": "function", "name": "add", "parameters": {"a": 1, "b": 2}}',
                 '{ "name": "add", "arguments": {"a": 1, "b": 2} }', '{"name": "add", "parameters": "{\\"a\\": 1, \\"b\\": 2}"}']:
        assert _calls("llama3-json", tag + body + stop, stop=stop) == [("add", {"a": 1, "b": 2}, "", "")]
        assert _calls("llama3-json", tag + body, stop=stop) == [("add", {"a": 1, "b": 2}, "", "")]


@pytest.mark.parametrize("text,calls", [
    ("3", []),
    ('The call: {"name": "add", "parameters": {"a": 1, "b": 2}}', []),  # text first: an answer
    ("<|python_tag|>print(1)", []),
    ('{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "s_none", "parameters": {}}',
     [("add", {"a": 1, "b": 2}, "", ""), ("s_none", {}, "limit", "error: at most 1 tool call a turn")]),
    ('{"name": "add", "parameters": {"a": 1, "b": 2}}\n{"name": "add", "parameters": {"a": 3, "b": 4}}',
     [("add", {"a": 1, "b": 2}, "", ""), ("add", {"a": 3, "b": 4}, "limit", "error: at most 1 tool call a turn")]),
    ('{"name": "add", "parameters": {"a": 1, "b": 2}} is my call',
     [("add", {}, "parse", "error: text after the tool call's JSON object (the call is the whole turn)")]),
    ('{"name": "add", "parameters": {"a": 1,', [("", {}, "parse", "error: the tool call is not valid JSON "
                                                "(Expecting property name enclosed in double quotes: line 1 column 39 (char 38))")]),
    ('{"type": "code", "name": "add"}', [("", {}, "parse", 'error: a tool call\'s "type" is "function", got "code"')]),
    ('{"name": "mul", "parameters": {}}', [("mul", {}, "unknown", "error: no tool named 'mul' (tools: add, lookup, s_none)")]),
    ('{"name": "add", "parameters": {"a": 1}}', [("add", {"a": 1}, "args", "error: add is missing the argument 'b'")]),
])
def test_llama_turns_that_are_answers_and_malformed_calls(text, calls):
    assert _calls("llama3-json", text) == calls


def test_the_call_limits_answer_the_extra_calls():
    one = '<tool_call>\n{"name": "s_none", "arguments": {}}\n</tool_call>'
    kinds = [(c.kind, c.content) for c in T.parse("hermes", one * 3, TOOLS, turn_limit=2)]
    assert kinds == [("", ""), ("", ""), ("limit", "error: at most 2 tool calls a turn")]
    kinds = [(c.kind, c.content) for c in T.parse("hermes", one * 3, TOOLS, used=7, max_calls=8)]
    assert kinds == [("", "")] + [("limit", "error: tool call limit 8 reached")] * 2
    assert [c.kind for c in T.parse("hermes", one * 5, TOOLS)] == [""] * 4 + ["limit"]  # hermes: 4 a turn by default
    assert T.parse("llama3-json", '{"name": "s_none"}', TOOLS, used=8, max_calls=8)[0].kind == "limit"


def test_an_error_line_is_one_short_ascii_line():
    line = T.error_line("add raised ValueError: caf\u00e9\nsecond line " + "x" * 300)
    assert line.startswith("error: add raised ValueError: caf\\xe9 second line x") and line.isascii()
    assert len(line) == 200 and line.endswith("...")


# ----------------------------------------------------------------------------- writing calls, rendering

CALLS = [{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}},
         {"type": "function", "function": {"name": "lookup", "arguments": '{"city": "Oslo", "unit": "f"}'}}]


def test_written_calls_read_back_on_both_formats():
    text = T.write_calls("hermes", CALLS, "I will call.")
    assert text == ('I will call.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
                    '<tool_call>\n{"name": "lookup", "arguments": {"city": "Oslo", "unit": "f"}}\n</tool_call>')
    assert _calls("hermes", text) == [("add", {"a": 1, "b": 2}, "", ""), ("lookup", {"city": "Oslo", "unit": "f"}, "", "")]
    text = T.write_calls("llama3-json", CALLS[1:])
    assert text == '{"name": "lookup", "parameters": {"city": "Oslo", "unit": "f"}}'
    assert _calls("llama3-json", text) == [("lookup", {"city": "Oslo", "unit": "f"}, "", "")]
    with pytest.raises(ValueError, match="llama3-json: a turn with a tool call is that one call alone"):
        T.write_calls("llama3-json", CALLS)
    with pytest.raises(ValueError, match="tool_calls: a tool call needs a \"name\" string"):
        T.write_calls("hermes", [{"function": {"arguments": {}}}])


def _hf(d):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(d)


@pytest.mark.parametrize("family", FAMILIES)
def test_floe_renders_tools_calls_and_results_as_transformers_does(tmp_path, family):
    d = _model_dir(tmp_path, family)
    ours, hf = D.TextCodec.load(d), _hf(d)
    fmt, fns = FORMAT[family], [add, lookup]
    schemas = [S.schema(f) for f in fns]
    prompt = [{"role": "system", "content": "Be exact."}, {"role": "user", "content": "What is 1 + 2?"}]
    calls = CALLS if fmt == "hermes" else CALLS[:1]
    results = T.tool_messages([T.Call("add", {}, content="3"), T.Call("lookup", {}, content='{"t": 21}')][:len(calls)])
    history = prompt + [{"role": "assistant", "content": "", "tool_calls": calls}] + results
    for messages, tools in [(prompt, None), (prompt, fns), (history, fns), (history + [{"role": "assistant", "content": "3"}], fns)]:
        kwargs = {"tools": schemas} if tools else {}
        text = hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        assert ours.render_text(messages, True, **kwargs) == text
        assert ours.render(messages, **kwargs) == hf.encode(text, add_special_tokens=False)
        assert ("Environment: ipython" in text or "# Tools" in text) == bool(tools)
    if fmt == "llama3-json":  # Llama prints its tool preamble for tools=[]: no tools means no keyword at all
        assert "Environment: ipython" in ours.render_text(prompt, True, tools=[])
    # the call as the template renders it is what write_calls writes, and what parse reads back
    head = "<|im_start|>assistant\n" if fmt == "hermes" else "<|start_header_id|>assistant<|end_header_id|>\n\n"
    rendered = ours.render_text(history, False, tools=schemas)
    written = T.write_calls(fmt, calls)
    assert head + written + ("<|im_end|>" if fmt == "hermes" else "<|eot_id|>") in rendered
    assert [(c.name, c.arguments, c.kind) for c in T.parse(fmt, written, S.toolset(fns))] == [
        (c["function"]["name"], c["function"]["arguments"] if isinstance(c["function"]["arguments"], dict)
         else json.loads(c["function"]["arguments"]), "") for c in calls]


@pytest.mark.parametrize("family", FAMILIES)
def test_sampled_call_ids_decoded_with_special_tokens_kept_parse(tmp_path, family):
    """What the parser reads is the sampled ids decoded with special tokens kept: Qwen3's tool tokens
    (special or not) and Llama's <|python_tag|> survive, and the stop id is cut."""
    codec = D.TextCodec.load(_model_dir(tmp_path, family))
    fmt = FORMAT[family]
    text = T.write_calls(fmt, CALLS[:1], "I add." if fmt == "hermes" else "")
    text = text if fmt == "hermes" else "<|python_tag|>" + text
    for stop in codec.stop_ids:
        ids = codec.encode(text) + [stop]
        assert len(ids) < len(text)  # the family's tokens are single ids
        decoded, stop_text = codec.decode_turn(ids + codec.encode("tail"))  # cut at the stop id
        assert decoded == text and stop_text == codec.tok.id_to_token(stop)
        assert _calls(fmt, decoded, stop=stop_text) == [("add", {"a": 1, "b": 2}, "", "")]
    assert codec.decode_turn(codec.encode(text)) == (text, "")  # cut by length: no stop token


@pytest.mark.parametrize("family", ["qwen3", "llama31"])
def test_a_truncated_result_keeps_the_templates_closing_tags(tmp_path, family):
    codec = D.TextCodec.load(_model_dir(tmp_path, family))
    content, cut = T.truncate("7" * 5000, 2000)
    assert cut == 3000 and content == "7" * 2000 + "...[truncated 3000 chars]"
    text = codec.render_text([{"role": "user", "content": "go"}, {"role": "tool", "name": "add", "content": content}], True)
    end = ("...[truncated 3000 chars]\n</tool_response><|im_end|>\n<|im_start|>assistant\n" if family == "qwen3" else
           '...[truncated 3000 chars]"<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n')
    assert text.endswith(end)
    codec.encode(text)  # the marker encodes on a character tokenizer


def test_results_and_the_messages_handed_to_rewards():
    assert [T.render_result(v) for v in ["caf\u00e9", 3, 2.5, True, None, [1, "\u00e9"], {"a": {"b": 1}}]] == [
        "caf\u00e9", "3", "2.5", "true", "null", '[1, "\u00e9"]', '{"a": {"b": 1}}']
    for bad in [{1, 2}, (1, 2), b"x", [{1}], object()]:
        with pytest.raises(TypeError):
            T.render_result(bad)
    calls = T.parse("hermes", T.write_calls("hermes", CALLS[:1]) + "\n<tool_call>{}</tool_call>", TOOLS)
    calls[0].content = "3"
    text = "<tool_call>..."
    assert T.assistant_message(text, calls) == {"role": "assistant", "content": text, "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}},
        {"type": "function", "function": {"name": "", "arguments": {}}}]}
    assert T.tool_messages(calls) == [{"role": "tool", "name": "add", "content": "3"},
                                      {"role": "tool", "name": "", "content": 'error: a tool call needs a "name" string'}]


# ----------------------------------------------------------------------------- running calls

class Faults:
    """Tools that fail on purpose; `gate` holds `hang` until the test releases it (no sleeps)."""

    def __init__(self, episodes: int = 1):
        self.gate, self.seen, self.lock = threading.Event(), [], threading.Lock()
        self.meet = threading.Barrier(episodes, timeout=5)

    def div(self, a: int, b: int) -> float:
        """Divide.

        Args:
            a: numerator
            b: denominator
        """
        return a / b

    def hang(self) -> str:
        """Wait for the gate."""
        self.gate.wait()
        return "late"

    def leave(self) -> str:
        """Exit."""
        raise SystemExit(3)

    def odd(self, kind: str) -> str:
        """A value that is not JSON, or a huge one, or one the tokenizer lacks.

        Args:
            kind: which
        """
        return {"set": {1, 2}, "huge": "x" * 100, "accent": "caf\u00e9", "tuple": (1, 2)}[kind]

    def log(self, item: list[int], tag: str) -> int:
        """Record the call, then change its argument.

        Args:
            item: a list
            tag: a name
        """
        with self.lock:
            self.seen.append((tag, list(item)))
        item.append(99)
        return len(self.seen)

    def together(self, k: int) -> int:
        """Return only once every episode's call has started (a Barrier): they run at once.

        Args:
            k: the episode
        """
        self.meet.wait()
        return k

    async def shout(self, q: str) -> str:
        """Async.

        Args:
            q: text
        """
        await asyncio.sleep(0)
        return q.upper()


def _runner(f: Faults, **kw) -> R.Runner:
    r = R.Runner(**kw)
    r.tools = S.toolset([f.div, f.hang, f.leave, f.odd, f.log, f.together, f.shout])
    return r


def _turn(fmt_calls: list[tuple[str, dict]], r: R.Runner) -> list[T.Call]:
    text = T.write_calls("hermes", [{"function": {"name": n, "arguments": a}} for n, a in fmt_calls])
    return T.parse("hermes", text, r.tools, max_calls=99)


def _run(r: R.Runner, batch: list[list[T.Call]]) -> float:
    return r.run(batch, [r.tools] * len(batch))


def test_a_tools_failures_are_results_with_their_lines_and_kinds():
    f = Faults()
    def check(text):
        if not text.isascii():
            raise ValueError(f"{text!r} holds characters the tokenizer lacks")
    r = _runner(f, timeout=0.2, max_chars=40, check=check)
    turn = _turn([("div", {"a": 1, "b": 0}), ("leave", {}), ("hang", {}), ("odd", {"kind": "set"})], r)
    turn2 = _turn([("odd", {"kind": "huge"}), ("odd", {"kind": "accent"}), ("shout", {"q": "hi"}), ("nope", {})], r)
    _run(r, [turn, turn2])
    assert [(c.kind, c.content) for c in turn] == [
        ("raised", "error: div raised ZeroDivisionError: division by zero"),
        ("raised", "error: leave raised SystemExit(3) (user code may not exit the run)"),
        ("timeout", "error: hang timed out after 0.2 s"),
        ("result", "error: odd returned what cannot be its result: set is not str, int, float, bool, None, list or dict")]
    assert [(c.kind, c.content, c.truncated) for c in turn2] == [
        ("", "x" * 40 + "...[truncated 60 chars]", 60),
        ("result", "error: odd returned what cannot be its result: 'caf\\xe9' holds characters the tokenizer lacks", 0),
        ("", "HI", 0), ("unknown", "error: no tool named 'nope' (tools: div, hang, leave, odd, log, together, shout)", 0)]
    assert r.abandoned() == 1
    f.gate.set()  # released, the abandoned call returns and is no longer counted
    assert all(done.wait(5) for _, done in r.abandoned_calls) and r.abandoned() == 0
    m = R.metrics([turn, turn2], turns=3, turns_with_calls=2, result_tokens=5, seconds=0.5, abandoned=0)
    assert m["tools/calls"] == (8.0, 2.0) and m["tools/turns_with_calls"] == (2.0, 3.0)
    assert {k: m[f"tools/errors/{k}"][0] for k in T.KINDS} == {"parse": 0, "unknown": 1, "args": 0, "raised": 2,
                                                                 "timeout": 1, "result": 2, "limit": 0}
    assert m["tools/truncated"] == (1.0, 8.0) and m["tools/calls/odd"] == (3.0, 2.0) and "tools/calls/nope" not in m
    assert m["tools/result_tokens"] == (5.0, 2.0) and m["time/tools"] == (0.5, 1.0)


def test_calls_run_in_order_within_an_episode_on_copies_and_episodes_at_once():
    f = Faults(episodes=3)
    r = _runner(f, timeout=10)
    eps = [_turn([("log", {"item": [k], "tag": f"{k}a"}), ("together", {"k": k}), ("log", {"item": [k], "tag": f"{k}b"})], r)
           for k in range(3)]
    _run(r, eps)
    assert [[c.content for c in e] for e in eps][0][1] == "0" and all(e[1].kind == "" for e in eps)  # the barrier met
    order = [tag for tag, _ in f.seen]
    for k in range(3):
        assert order.index(f"{k}a") < order.index(f"{k}b")
    assert all(item == [int(tag[0])] for tag, item in f.seen)
    assert eps[0][0].arguments == {"item": [0], "tag": "0a"}  # the tool changed its copy, not the call


def test_more_than_256_abandoned_calls_stop_the_run_naming_the_tool():
    f = Faults()
    r = _runner(f, timeout=0.05)
    try:
        _run(r, [_turn([("hang", {})], r) for _ in range(200)])
        assert r.abandoned() == 200
        with pytest.raises(R.HungTools) as e:
            _run(r, [_turn([("hang", {})], r) for _ in range(57)])
        assert str(e.value) == ("257 timed-out tool calls are still running (257 of them calls of hang): make hang "
                                "return, or give it longer with --tool-timeout (now 0.05 s)")
    finally:
        f.gate.set()
