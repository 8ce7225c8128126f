"""Tools: typed Python functions the model calls, in its family's own call format.

A tool is a plain function with a type hint on every parameter and a Google-style docstring
whose `Args:` block has a line for each (the convention of transformers' `get_json_schema`,
which TRL and verl use too):

    def add(a: int, b: int) -> int:
        '''Add two integers.

        Args:
            a: the first
            b: the second
        '''
        return a + b

This module owns what lies between such a function and the episode loop:
1. `schema(fn)`: the JSON schema the chat template prints. floe builds it itself (transformers
   stays a test-only dependency) equal to `get_json_schema(fn)` key for key and in key order: the
   template prints it with `tojson`, which keeps the order, so any difference is another prompt.
   What JSON cannot carry is refused in one line, where `get_json_schema` would guess "object".
2. Two call formats: `hermes` (Qwen3, Qwen2.5: `<tool_call>` blocks of {"name", "arguments"},
   several a turn) and `llama3-json` (Llama 3.1, 3.2: the whole turn one {"name", "parameters"}
   object, after an optional <|python_tag|>); `detect_format` reads which from the template.
   `parse` reads a turn decoded with special tokens kept: no call attempt is an answer; a
   malformed attempt is answered with one error line and counted, never taken for an answer
   (TRL's parser falls back to one). `write_calls` writes OpenAI-shaped `tool_calls` (an SFT
   reference) as the exact text `parse` reads back.
3. Results: a str as it is; numbers, bools, None, lists and dicts as JSON; cut past a length
   with an ASCII marker before the template renders them, so its closing tags survive.
4. `load`: the --tool functions, by path or module, as rewards are given.

agents/toolrun.py runs the calls (a timeout each, on tasks/usercode.py's threads) and counts them.

Simplifications:
1. Arguments are checked for their schema's JSON types (array items, object values and enums
   included) and nothing finer: a tool that needs a range checks it itself and raises.
2. Arguments given as a JSON string (as OpenAI's API writes them) are decoded; a call without
   arguments has {} (a tool of no parameters).
3. Every attempt counts towards the episode's call limit, malformed ones too.

This module is layer 1: the standard library and tasks/usercode.py. Tests: tests/test_toolcalls.py.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable

from tasks import usercode

KINDS = ("parse", "unknown", "args", "raised", "timeout", "result", "limit")  # what can go wrong with a call
FORMATS = ("hermes", "llama3-json")
PER_TURN = {"hermes": 4, "llama3-json": 1}  # calls a turn by default; Llama's template refuses a second
PYTHON_TAG = "<|python_tag|>"


# ----------------------------------------------------------------------------- schemas

NoneType = type(None)
_BASIC = {int: {"type": "integer"}, float: {"type": "number"}, str: {"type": "string"}, bool: {"type": "boolean"},
          NoneType: {"type": "null"}, list: {"type": "array"}, dict: {"type": "object"}, Any: {}}
_SECTIONS = ("Args:", "Returns:", "Raises:")
_ARG_LINE = re.compile(r"(\s*)(\w+):\s*(.*)")
_CHOICES = re.compile(r"\(choices:\s*(.*?)\)\s*$", re.IGNORECASE)


@dataclass
class Tool:
    """A declared tool: its name, the function, and the schema the chat template prints for it."""

    name: str
    fn: Callable
    schema: dict  # {"type": "function", "function": {"name", "description", "parameters"[, "return"]}}


def _type_schema(hint, where: str) -> dict:
    """A type hint's JSON schema, shaped as get_json_schema shapes it; ValueError when JSON has no
    such type (a class of the user's, a tuple, a dict keyed by other than str)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is None and hint in _BASIC:
        return dict(_BASIC[hint])
    if origin in (typing.Union, types.UnionType):
        subs = [_type_schema(a, where) for a in args if a is not NoneType]
        if len(subs) == 1:
            out = subs[0]
        elif all(list(s) == ["type"] and isinstance(s["type"], str) for s in subs):  # plain types: a type list
            names = sorted({s["type"] for s in subs})
            out = {"type": names[0] if len(names) == 1 else names}
        else:
            out = {"anyOf": subs}
        if NoneType in args:
            out["nullable"] = True
        return out
    if origin is list and len(args) == 1:
        return {"type": "array", "items": _type_schema(args[0], where)}
    if origin is dict and len(args) == 2 and args[0] is str:  # JSON object keys are strings
        return {"type": "object", "additionalProperties": _type_schema(args[1], where)}
    shown = hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")
    raise ValueError(f"{where}: type {shown} has no JSON schema (int, float, str, bool, "
                     "Any, list[T], dict[str, V], X | None)")


def _docstring(doc: str) -> tuple[str, dict[str, str], str | None]:
    """A Google-style docstring's description, each `Args:` line's text (continuation lines joined
    by one space) and the `Returns:` block (None without one)."""
    parts, section = {"": []}, ""
    for line in doc.strip().split("\n"):
        if line.strip() in _SECTIONS:
            section = line.strip()[:-1]
            parts[section] = []
        else:
            parts[section].append(line)
    args, name, indent = {}, None, None
    for line in parts.get("Args", []):
        m = _ARG_LINE.fullmatch(line)
        if m and (indent is None or len(m.group(1)) <= indent):  # a new argument, not a wrapped line
            name, indent = m.group(2), len(m.group(1))
            args[name] = m.group(3).strip()
        elif name is not None and line.strip():
            args[name] = f"{args[name]} {line.strip()}".strip()
    returns = "\n".join(parts["Returns"]).strip() if "Returns" in parts else None
    return "\n".join(parts[""]).strip(), args, returns


def _parameter(name: str, hint, text: str, where: str) -> dict:
    """One property: its type, the enum its description ends with (`(choices: [...])`), the description."""
    out = _type_schema(hint, where)
    if m := _CHOICES.search(text):
        choices = _loads(m.group(1))
        if not isinstance(choices, list):
            raise ValueError(f"{where}: (choices: {m.group(1)}) is not a JSON list")
        out["enum"] = [c.strip() if isinstance(c, str) else c for c in choices]
        text = text[:m.start()].strip()
    out["description"] = text
    return out


def schema(fn: Callable) -> dict:
    """The JSON schema of a typed, documented function (or bound method: `self` is not a
    parameter), equal to transformers' get_json_schema(fn) key for key and in key order.
    ValueError, one line naming the function and the parameter, for what it cannot describe."""
    name = getattr(fn, "__name__", None)
    if not callable(fn) or not isinstance(name, str) or not (inspect.isfunction(fn) or inspect.ismethod(fn)):
        raise ValueError(f"tool {fn!r}: not a function or a method")
    try:
        hints = typing.get_type_hints(fn)
    except Exception as e:  # a forward reference that does not resolve
        raise ValueError(f"tool {name}: its type hints do not resolve ({usercode.describe(e)})") from None
    params = list(inspect.signature(fn).parameters.values())
    if params and params[0].name in ("self", "cls") and params[0].annotation is inspect.Parameter.empty:
        params = params[1:]  # a plain function written as a method: its receiver is no argument
    doc = inspect.getdoc(fn)
    if not doc:  # what else is missing too, so that one fix is enough
        bare = [p.name for p in params if p.name not in hints and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        also = f" and no type hint on {', '.join(bare)}" if bare else ""
        raise ValueError(f"tool {name}: no docstring{also} (it needs a docstring with an Args: line per parameter"
                         + (", and a type hint on each)" if bare else ")"))
    description, lines, returns = _docstring(doc)
    properties, required = {}, []
    for p in params:
        where = f"tool {name}: parameter {p.name}"
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise ValueError(f"{where}: *args and **kwargs have no JSON schema; name each parameter")
        if p.kind is p.POSITIONAL_ONLY:
            raise ValueError(f"{where}: positional-only, but a call passes its arguments by name")
        missing = [what for what, ok in (("no type hint", p.name in hints),
                                         ("no line in the docstring's Args: block", p.name in lines)) if not ok]
        if missing:
            raise ValueError(f"{where}: {' and '.join(missing)}")
        properties[p.name] = _parameter(p.name, hints[p.name], lines[p.name], where)
        if p.default is inspect.Parameter.empty:
            required.append(p.name)
    parameters = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    out = {"name": name, "description": description, "parameters": parameters}
    if "return" in hints:
        out["return"] = _type_schema(hints["return"], f"tool {name}: its return")
        if returns is not None:
            out["return"]["description"] = returns
    return {"type": "function", "function": out}


def toolset(fns: list[Callable], origins: list[str] | None = None) -> dict[str, Tool]:
    """Tools by name, each schema built; ValueError for two of one name (a call names one), naming
    where each came from: `origins` (the --tool values), else each function's file and name."""
    out: dict[str, Tool] = {}
    came: dict[str, str] = {}  # a tool's name -> where it came from
    for fn, where in zip(fns, origins or [origin(fn) for fn in fns]):
        s = schema(fn)
        t = Tool(s["function"]["name"], fn, s)
        if t.name in out:
            if came[t.name] == where:
                raise ValueError(f"{where} is given twice; give each tool once")
            raise ValueError(f"{came[t.name]} and {where} are both named {t.name!r}: a call names a tool by its "
                             "function's name, so each needs its own")
        out[t.name], came[t.name] = t, where
    return out


def origin(fn: Callable) -> str:
    """Where a tool's function is defined, as a --tool value names it: its file (relative to the working
    directory when under it) and name, or its module and name where it has no file."""
    path = inspect.getsourcefile(fn) or ""
    if path:
        rel = os.path.relpath(path)
        path = path if rel.startswith("..") else rel
    return f"{path or fn.__module__}:{fn.__qualname__}"


def load(specs: tuple[str, ...], timeout: float = 60.0) -> list[Callable]:
    """The --tool functions (`path/to/file.py:fn` or `module:fn`, as rewards are given); ValueError,
    one line, for one that does not import, names nothing, or is not a function."""
    fns = []
    for spec in specs:
        try:
            fn, _ = usercode.load(spec, "--tool", timeout=timeout)
        except usercode.LoadError as e:
            raise ValueError(str(e)) from None
        if not (inspect.isfunction(fn) or inspect.ismethod(fn)):
            raise ValueError(f"--tool {spec}: {fn!r} is not a function")
        fns.append(fn)
    return fns


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
