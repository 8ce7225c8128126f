"""Rewards: the reward-function contract, the built-in ones, loading one by name or path, and
a step's reward calls, all at once.

A reward function has TRL's shape: it gets `prompts` (as the task gave them), `completions`
(text, cut at the stop token), `completion_ids`, and each other column of the task's rows as a
keyword argument holding a list aligned with the completions; it returns one float per completion:

    def reward(prompts, completions, answer, **kwargs) -> list[float]

`--reward path/to/file.py:fn` or `--reward module:fn` loads one (repeat the flag for several,
`--reward-weights` to weigh them; the total is the weighted sum). Built-in names need no code:
`numeric_match` and `exact_match` against an `answer` column, `similarity` against `target`.

Simplifications:
1. A reward function is called once per prompt group (its `--group-size` completions), so a
   call that raises skips one group, not the step; the failure is printed and counted
   (`skipped/reward_error`). A None or NaN skips that sample; a wrong-length return, or a value
   that is not a real number (usercode.number), stops the run with one line naming the function.
   A step's calls run at once, each on its own thread (`score_groups`): a hung reward costs a step
   one --call-timeout, not one per group, and a function may run in several threads together.
2. A function is loaded, and its file's top-level code run, at start-up (and again on --resume:
   it is an import); the columns it asks for by name (`Reward.needs`: a parameter with a default
   may be missing) are checked against every row when the task is built (tasks/task.py).

    python train.py --task jsonl:examples/sums.jsonl --model checkpoints/arith-tiny --reward examples/rewards.py:close
"""

from __future__ import annotations

import asyncio
import difflib
import hashlib
import inspect
import math
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from config import ConfigError
from data import Prompt, RunError
from tasks import usercode

CALL_ARGS = ("prompts", "completions", "completion_ids", "messages")  # a call's own arguments: no column takes these


def similarity(prompts, completions, target, **kwargs) -> list[float]:
    """difflib's SequenceMatcher ratio between the completion and the `target` column."""
    return [difflib.SequenceMatcher(None, c, t).ratio() for c, t in zip(completions, target)]


def exact_match(prompts, completions, answer, **kwargs) -> list[float]:
    """1 when the completion, stripped, is the `answer` column's text, else 0."""
    return [float(c.strip() == str(a).strip()) for c, a in zip(completions, answer)]


def numeric_match(prompts, completions, answer, **kwargs) -> list[float]:
    """1 when the completion's answer (the last \\boxed{} content, else the last number in it)
    equals the `answer` column as a number (GSM8K-style: commas dropped), else 0."""
    return [float(_same_number(final_number(c), a)) for c, a in zip(completions, answer)]


BUILTIN = {"similarity": similarity, "exact_match": exact_match, "numeric_match": numeric_match}
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(text: str) -> str | None:
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", text)
    found = NUMBER.findall(boxed[-1] if boxed else text)
    return found[-1] if found else None


def _same_number(x: str | None, answer) -> bool:
    if x is None or answer is None:
        return False
    try:
        a, b = float(x.replace(",", "")), float(str(answer).replace(",", "").strip())
    except ValueError:
        return False
    return abs(a - b) <= 1e-6 * max(1.0, abs(b))


@dataclass
class Reward:
    """One reward function, its weight in the total, and the file it came from (hashed with the run)."""

    name: str  # as given to --reward
    fn: Callable
    weight: float = 1.0
    source: Path | None = None  # None for the built-ins
    timeout: float = 60.0  # --call-timeout: seconds one call may take (tasks/usercode.py)
    stop: threading.Event | None = None  # set when the run shuts down: a call still running is abandoned at once

    def needs(self) -> list[str]:
        """The columns the function asks for by name (parameters without a default)."""
        params = inspect.signature(self.fn).parameters.values()
        return [p.name for p in params if p.default is p.empty and p.name not in CALL_ARGS
                and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]

    def call(self, prompts: list[Prompt], texts: list[str], ids: list[list[int]],
             extra: dict[str, list] | None = None) -> Callable[[], object]:
        """One group's call, ready for usercode.call_all; the function gets copies: what it changes is
        not what floe trains on."""
        columns = {k: [p.columns.get(k) for p in prompts] for k in dict.fromkeys(k for p in prompts for k in p.columns)}
        kwargs = usercode.copied({"prompts": [p.prompt for p in prompts], "completions": texts,
                                  "completion_ids": ids, **columns, **(extra or {})})
        if inspect.iscoroutinefunction(self.fn):  # an async reward (TRL takes them too) runs to completion there
            return lambda: asyncio.run(self.fn(**kwargs))
        return lambda: self.fn(**kwargs)

    def values(self, res: usercode.Result, n: int) -> list[float]:
        """One float per completion from a call's result; NaN for each sample of a call that raised or
        timed out, and for None/NaN. A value that is not a number stops the run (usercode.number)."""
        if not res.ok and self.stop is not None and self.stop.is_set():
            return [math.nan] * n  # the run is shutting down: the batch is never trained on
        if not res.ok:  # a user's function: an outage skips its samples, loudly
            why = f"took longer than --call-timeout {self.timeout:g}s" if res.timed_out else f"raised {res.error}"
            print(f"warning: reward {self.name} {why} ({n} samples skipped, counted in skipped/reward_error)", flush=True)
            return [math.nan] * n
        out = res.value
        if not isinstance(out, (list, tuple)) and not (hasattr(out, "__len__") and hasattr(out, "__iter__")):
            raise RunError(f"reward {self.name} returned {type(out).__name__} {str(out)[:40]!r}, not a list "
                           "(it must return one float per completion)")
        out = list(out)
        if len(out) != n:
            raise RunError(f"reward {self.name} returned {len(out)} values for {n} completions "
                           "(it must return one float per completion)")
        try:
            return [math.nan if v is None else usercode.number(v) for v in out]
        except TypeError as e:
            raise RunError(f"reward {self.name} returned {e} for a completion (a real number, or None to skip it)") from None


def score_groups(rewards: list[Reward], groups: list[tuple]) -> list[list[float]]:
    """Each group's weighted reward sum per completion; `groups` holds each one's (prompts, texts, ids, extra).
    Every function's call on every group runs at once (usercode.call_all), so a step whose rewards hang
    waits one --call-timeout, not one per group; each call keeps its own thread, copies and result."""
    calls = [r.call(*g) for g in groups for r in rewards]
    results = iter(usercode.call_all(calls, max((r.timeout for r in rewards), default=0.0),
                                     rewards[0].stop if rewards else None))
    out = []
    for g in groups:
        total = [0.0] * len(g[1])
        for r in rewards:
            total = [t + r.weight * v for t, v in zip(total, r.values(next(results), len(g[1])))]
        out.append(total)
    return out


def load_reward(spec: str, weight: float = 1.0, timeout: float = 60.0) -> Reward:
    """A built-in name, `path/to/file.py:fn` or `module:fn`; ConfigError (one line) when it does not load."""
    try:
        fn, path = usercode.load(spec, "--reward", BUILTIN, "function", timeout)
    except usercode.LoadError as e:
        raise ConfigError(str(e)) from None
    if not callable(fn):
        raise ConfigError(f"--reward {spec}: {spec.rpartition(':')[0]} has no function {spec.rpartition(':')[2]!r}")
    return Reward(spec, fn, weight, path, timeout)


def load_rewards(specs: tuple[str, ...], weights: tuple[float, ...], timeout: float = 60.0) -> list[Reward]:
    if weights and len(weights) != len(specs):
        raise ConfigError(f"--reward-weights: {len(weights)} weights for {len(specs)} --reward functions")
    return [load_reward(s, w, timeout) for s, w in zip(specs, weights or [1.0] * len(specs))]


def reward_hashes(rewards: list[Reward]) -> dict[str, str]:
    """sha256 of each reward's source file, saved with the run (--resume says when one changed)."""
    return {r.name: hashlib.sha256(r.source.read_bytes()).hexdigest() for r in rewards if r.source}
