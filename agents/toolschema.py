"""Tool schemas: typed Python functions as the JSON schemas a chat template prints, and --tool's functions.

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

This module owns what lies between such a function and a call of it:
1. `schema(fn)`: the JSON schema the chat template prints. floe builds it itself (transformers
   stays a test-only dependency) equal to `get_json_schema(fn)` key for key and in key order: the
   template prints it with `tojson`, which keeps the order, so any difference is another prompt.
2. `toolset`: the tools by name (`Tool`: the name, the function, its schema); two of one name are
   refused, naming where each came from (`origin`).
3. `load`: the --tool functions, by path or module, as rewards are given.

agents/toolcalls.py reads and checks a turn's calls against these schemas; agents/toolrun.py runs them.

Simplifications:
1. The types are JSON's: int, float, str, bool, None, Any, `list[T]`, `dict[str, V]` and unions of
   them (`X | None` is nullable). What JSON cannot carry (a class, a tuple, *args) is refused in
   one line, where `get_json_schema` would guess "object".
2. An enum is the `(choices: [...])` a parameter's description ends with; nothing finer (a range, a
   format) is in a schema.

This module is layer 1: the standard library and tasks/usercode.py.

    python -m pytest -q tests/test_toolcalls.py -k "schema or one_name"   # --tool's load: tests/test_tools.py
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
        try:
            choices = json.loads(m.group(1))
        except ValueError:  # not JSON: refused below, as not a list
            choices = None
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
