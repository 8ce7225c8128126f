"""Tool calls: a model turn read as calls in its family's own call format, checked, and answered.

The tools are typed Python functions; agents/toolschema.py makes their schemas (`schema`, `toolset`:
`Tool` by name) and loads --tool's. This module owns what lies between a sampled turn and the
episode loop:
1. Two call formats: `hermes` (Qwen3, Qwen2.5: `<tool_call>` blocks of {"name", "arguments"},
   several a turn) and `llama3-json` (Llama 3.1, 3.2: the whole turn one {"name", "parameters"}
   object, after an optional <|python_tag|>); `detect_format` reads which from the template.
   `parse` reads a turn decoded with special tokens kept: no call attempt is an answer; a
   malformed attempt is answered with one error line and counted, never taken for an answer
   (TRL's parser falls back to one). `write_calls` writes OpenAI-shaped `tool_calls` (an SFT
   reference) as the exact text `parse` reads back.
2. Results: a str as it is; numbers, bools, None, lists and dicts as JSON; cut past a length
   with an ASCII marker before the template renders them, so its closing tags survive.

agents/toolrun.py runs the calls (a timeout each, on tasks/usercode.py's threads) and counts them.

Simplifications:
1. Arguments are checked for their schema's JSON types (array items, object values and enums
   included) and nothing finer: a tool that needs a range checks it itself and raises.
2. Arguments given as a JSON string (as OpenAI's API writes them) are decoded; a call without
   arguments has {} (a tool of no parameters).
3. Every attempt counts towards the episode's call limit, malformed ones too.

This module is layer 2: the standard library and agents/toolschema.py (`Tool`). Tests: tests/test_toolcalls.py.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from agents.toolschema import Tool

KINDS = ("parse", "unknown", "args", "raised", "timeout", "result", "limit")  # what can go wrong with a call
FORMATS = ("hermes", "llama3-json")
PER_TURN = {"hermes": 4, "llama3-json": 1}  # calls a turn by default; Llama's template refuses a second
PYTHON_TAG = "<|python_tag|>"


# ----------------------------------------------------------------------------- formats

def detect_format(template: str | None) -> str | None:
    """The call format a chat template's source writes (`--tool-format auto`); None when neither, and
    the caller asks for --tool-format."""
    if template and "<tool_call>" in template:
        return "hermes"
    if template and ("ipython" in template or PYTHON_TAG in template):
        return "llama3-json"
    return None


# ----------------------------------------------------------------------------- parsing a turn

@dataclass
class Call:
    """One call attempt of a model turn, and then its result. A malformed attempt has its `kind`
    and its error line as `content` from the start; a run call gets them from the Runner."""

    name: str  # "" when the text names none
    arguments: dict  # as the model wrote them ({} when they could not be read)
    kind: str = ""  # "" while well-formed and after a good result, else one of KINDS
    content: str = ""  # the tool message's content: the result, or the one error line
    truncated: int = 0  # characters cut from the result


def error_line(text: str) -> str:
    """What a malformed or failed call is answered: one line of printable ASCII (it must encode on
    a character tokenizer), at most 200 characters, starting "error: "."""
    line = "error: " + " ".join(text.split()).encode("ascii", "backslashreplace").decode()
    return line if len(line) <= 200 else line[:197] + "..."


def _bad(kind: str, text: str, name: str = "", arguments: dict | None = None) -> Call:
    return Call(name, arguments or {}, kind, error_line(text))


def _outside_think(text: str) -> str:
    """The turn without its thinking: a `</think>` with no opening one closes what the generation
    prompt opened (everything before it is thinking); an unclosed `<think>` runs to the end."""
    close = text.find("</think>")
    if close >= 0 and "<think>" not in text[:close]:
        text = text[close + len("</think>"):]
    return re.sub(r"<think>.*?(?:</think>|\Z)", "", text, flags=re.DOTALL)


def _loads(text: str):
    """JSON text's value, None when it is not JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return None


def _call(obj, key: str) -> Call:
    """A decoded JSON value as a call: an object with a "name" string and its arguments under `key`."""
    if not isinstance(obj, dict):
        return _bad("parse", f"a tool call is a JSON object, got {json.dumps(obj)[:60]}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return _bad("parse", 'a tool call needs a "name" string')
    args = obj.get(key, {})
    args = _loads(args) if isinstance(args, str) else args  # OpenAI's API writes arguments as a JSON string
    if not isinstance(args, dict):
        return _bad("parse", f'the "{key}" of a call of {name} must be a JSON object', name)
    return Call(name, args)


def _json(text: str, key: str) -> Call:
    try:
        return _call(json.loads(text), key)
    except ValueError as e:
        return _bad("parse", f"the tool call is not valid JSON ({e})")


def _hermes(text: str) -> list[Call]:
    """Every `<tool_call>...</tool_call>` block outside the thinking, in order; text around them is free."""
    out = []
    for m in re.finditer(r"<tool_call>(.*?)(</tool_call>|\Z)", _outside_think(text), re.DOTALL):
        out.append(_json(m.group(1).strip(), "arguments") if m.group(2) else _bad("parse", "<tool_call> without </tool_call>"))
    return out


def _llama(text: str) -> list[Call]:
    """The whole turn as JSON objects (one is the format; a second, after whitespace or `;`, is read so
    that it can be answered as over the limit)."""
    s = text.strip()
    s = s[len(PYTHON_TAG):].lstrip() if s.startswith(PYTHON_TAG) else s
    if not s.startswith("{"):
        return []
    out, at, decoder = [], 0, json.JSONDecoder()
    while at < len(s):
        try:
            obj, at = decoder.raw_decode(s, at)
        except ValueError as e:
            return out + [_bad("parse", f"the tool call is not valid JSON ({e})")]
        key = "parameters" if isinstance(obj, dict) and "parameters" in obj else "arguments"
        if isinstance(obj, dict) and obj.get("type", "function") != "function":
            out.append(_bad("parse", f'a tool call\'s "type" is "function", got {json.dumps(obj["type"])[:40]}'))
        else:
            out.append(_call(obj, key))
        rest = s[at:].lstrip().removeprefix(";").lstrip()
        if rest and not rest.startswith("{"):
            out[-1] = _bad("parse", "text after the tool call's JSON object (the call is the whole turn)", out[-1].name)
            break
        at = len(s) - len(rest)
    return out


def _expect(s: dict) -> str:
    """What a schema accepts, in words, for an error line."""
    if "enum" in s:
        return "one of " + json.dumps(s["enum"])
    t = s.get("type", "any value")
    words = " or ".join(_expect(x) for x in s["anyOf"]) if "anyOf" in s else " or ".join(t) if isinstance(t, list) else t
    words = f"array of {_expect(s['items'])}" if "items" in s else words
    return words + (" or null" if s.get("nullable") else "")


_IS = {"integer": lambda v: type(v) is int, "number": lambda v: type(v) in (int, float),
       "string": lambda v: isinstance(v, str), "boolean": lambda v: isinstance(v, bool),
       "null": lambda v: v is None, "array": lambda v: isinstance(v, list), "object": lambda v: isinstance(v, dict)}


def _fits(v, s: dict) -> bool:
    """Whether a JSON value has a schema's JSON type (bool is no integer here: JSON tells them apart)."""
    if v is None and s.get("nullable"):
        return True
    if "enum" in s and not any(v == e and type(v) is type(e) for e in s["enum"]):
        return False
    if "anyOf" in s:
        return any(_fits(v, x) for x in s["anyOf"])
    t = s.get("type")
    if t is not None and not any(_IS[k](v) for k in (t if isinstance(t, list) else [t])):
        return False
    if isinstance(v, list) and "items" in s:
        return all(_fits(x, s["items"]) for x in v)
    if isinstance(v, dict) and "additionalProperties" in s:
        return all(_fits(x, s["additionalProperties"]) for x in v.values())
    return True


def check_call(c: Call, tools: dict[str, Tool]) -> Call:
    """A parsed call checked against the declared tools: unknown name, missing, unexpected or
    mistyped arguments become that call's error."""
    if c.kind:
        return c
    tool = tools.get(c.name)
    if tool is None:
        return _bad("unknown", f"no tool named {c.name!r} (tools: {', '.join(tools) or 'none'})", c.name, c.arguments)
    parameters = tool.schema["function"]["parameters"]
    props, required = parameters["properties"], parameters.get("required", [])
    for k in c.arguments:
        if k not in props:
            return _bad("args", f"{c.name} has no argument {k!r} (it takes {', '.join(props) or 'none'})", c.name, c.arguments)
    for k in required:
        if k not in c.arguments:
            return _bad("args", f"{c.name} is missing the argument {k!r}", c.name, c.arguments)
    for k, v in c.arguments.items():
        if not _fits(v, props[k]):
            return _bad("args", f"{c.name}: argument {k!r} must be {_expect(props[k])}, got {json.dumps(v)[:40]}",
                        c.name, c.arguments)
    return c


def parse(fmt: str, text: str, tools: dict[str, Tool], stop: str = "", turn_limit: int = 0,
          used: int = 0, max_calls: int = 8) -> list[Call]:
    """A model turn's call attempts, in order, each well-formed or answered with its error line;
    [] when the turn is an answer. `text` is the turn decoded with special tokens kept, cut at its
    stop token (`stop`, the text of the token that ended it: a copy left at the end is cut too);
    `used` calls the episode made before, of `max_calls`; `turn_limit` a turn (0: the format's)."""
    text = text[:-len(stop)] if stop and text.endswith(stop) else text
    attempts = _hermes(text) if fmt == "hermes" else _llama(text)
    limit = turn_limit or PER_TURN[fmt]
    out = []
    for k, c in enumerate(attempts):
        if used + k >= max_calls:
            out.append(_bad("limit", f"tool call limit {max_calls} reached", c.name, c.arguments))
        elif k >= limit:
            out.append(_bad("limit", f"at most {limit} tool call{'s' if limit > 1 else ''} a turn", c.name, c.arguments))
        else:
            out.append(check_call(c, tools))
    return out


def write_calls(fmt: str, tool_calls: list[dict], content: str = "") -> str:
    """OpenAI-shaped `tool_calls` ({"function": {"name", "arguments"}}, arguments an object or its
    JSON string) as the family's call text, exactly what `parse` reads back: hermes
    `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>` after the content, one a line;
    llama3-json `{"name": ..., "parameters": ...}`, the whole turn. ValueError for what the
    format cannot hold."""
    calls = []
    for tc in tool_calls:
        c = _call(tc.get("function", tc) if isinstance(tc, dict) else tc, "arguments")
        if c.kind:
            raise ValueError(f"tool_calls: {c.content.removeprefix('error: ')}: {json.dumps(tc)[:80]}")
        calls.append(c)
    if fmt == "llama3-json":
        if len(calls) != 1 or content:
            raise ValueError("llama3-json: a turn with a tool call is that one call alone (no content, no second call)")
        return json.dumps({"name": calls[0].name, "parameters": calls[0].arguments}, ensure_ascii=False)
    blocks = [f'<tool_call>\n{json.dumps({"name": c.name, "arguments": c.arguments}, ensure_ascii=False)}\n</tool_call>'
              for c in calls]
    return "\n".join(([content] if content else []) + blocks)


# ----------------------------------------------------------------------------- results and messages

def render_result(value: Any) -> str:
    """A tool's return value as the tool message's content; TypeError for what JSON cannot hold."""
    if isinstance(value, str):
        return value
    if value is None or isinstance(value, (bool, int, float, list, dict)):
        return json.dumps(value, ensure_ascii=False)  # a list holding a set raises TypeError here
    raise TypeError(f"{type(value).__name__} is not str, int, float, bool, None, list or dict")


def truncate(content: str, max_chars: int) -> tuple[str, int]:
    """The content cut to `max_chars` with an ASCII marker saying how much went, and that count."""
    cut = len(content) - max_chars
    return (content, 0) if cut <= 0 else (f"{content[:max_chars]}...[truncated {cut} chars]", cut)


def tool_messages(calls: list[Call]) -> list[dict]:
    """The turn's results as messages, one per call in order (a malformed one's error line included)."""
    return [{"role": "tool", "name": c.name, "content": c.content} for c in calls]


def assistant_message(text: str, calls: list[Call]) -> dict:
    """A call turn as TRL hands it to reward functions: the sampled text and the OpenAI-shaped calls."""
    return {"role": "assistant", "content": text,
            "tool_calls": [{"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]}
