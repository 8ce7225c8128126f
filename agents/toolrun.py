"""Running tool calls: a timeout each on tasks/usercode.py's threads, results the model reads, and counts.

agents/toolcalls.py turns a model turn into calls; this module runs them for the episode loop
(agents/episodes.py) and says what they cost:
1. `Runner` runs a turn's well-formed calls on tasks/usercode.py's worker threads with --tool-timeout
   (TRL and verl's function tools have none), on deep copies of their arguments, a coroutine run
   to completion there. A tool that raises (SystemExit included), hangs or returns what JSON
   cannot hold gives a result the model reads, not a fault: every peer feeds these back, and a
   model can learn to avoid them. One episode's calls run in the order written (a stateful tool
   sees that order), a turn's episodes at once, so calls waiting on I/O overlap (CPU-bound ones
   cannot, under the GIL). A hung thread cannot be killed: it is abandoned and counted, and more
   than MAX_ABANDONED alive stop the run (a tool that must be killable runs its own subprocess).
2. `Tools`: what a run's episodes need of the tools (the --tool ones, the format, the limits, the
   runner); envcheck.check_tools builds it after the start checks.
3. `metrics`: a step's (sum, count) tool metrics, as the episodes' other statistics.

This module is layer 3: tasks/usercode.py, data.py (RunError), agents/toolcalls.py and agents/toolschema.py (Tool).

    python -m pytest -q tests/test_toolcalls.py tests/test_tools.py
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from data import RunError
from agents.toolcalls import Call, KINDS, PER_TURN, error_line, render_result, truncate
from agents.toolschema import Tool
from tasks import usercode

MAX_ABANDONED = 256  # hung calls alive at once before the run stops: each holds a thread for good


class HungTools(RunError):
    """More abandoned calls alive than MAX_ABANDONED: the message is the line that stops the run (exit 1)."""


def _invoke(fn: Callable, args: dict, done: threading.Event) -> Any:
    """One call on its worker thread, an async tool run to completion there; `done` marks its end,
    so an abandoned call is known to have finished."""
    try:
        value = fn(**args)
        return asyncio.run(value) if inspect.iscoroutine(value) else value
    finally:
        done.set()


@dataclass
class Runner:
    """Runs a turn's well-formed calls, episodes at once, each episode's calls in order."""

    timeout: float = 10.0  # --tool-timeout
    max_chars: int = 2000  # --max-tool-result-chars
    check: Callable[[str], Any] | None = None  # raises ValueError for content the tokenizer cannot encode
    abandoned_calls: list[tuple[str, threading.Event]] = field(default_factory=list)

    def run(self, batch: list[list[Call]], toolsets: list[dict[str, Tool]], stop: threading.Event | None = None) -> float:
        """Fill in each well-formed call's result (kind and content), in place, episode k's calls from
        toolsets[k]; the wall seconds taken. Round r runs the r-th calls of every episode at once,
        each with the whole timeout; `stop` set (the run shuts down) abandons a running call at once."""
        start = time.monotonic()
        for r in range(max((len(calls) for calls in batch), default=0)):
            todo = [(calls[r], tools) for calls, tools in zip(batch, toolsets) if r < len(calls) and not calls[r].kind]
            done = [threading.Event() for _ in todo]
            fns = [(lambda c=c, t=t, d=d, a=usercode.copied(c.arguments): _invoke(t[c.name].fn, a, d))
                   for (c, t), d in zip(todo, done)]
            for (c, _), d, res in zip(todo, done, usercode.call_all(fns, self.timeout, stop)):
                if res.timed_out:
                    self.abandoned_calls.append((c.name, d))
                self._result(c, res)
            if self.abandoned() > MAX_ABANDONED:  # each holds a thread until the process ends
                name, n = Counter(n for n, _ in self.abandoned_calls).most_common(1)[0]
                raise HungTools(f"{len(self.abandoned_calls)} timed-out tool calls are still running ({n} of them "
                                f"calls of {name}): make {name} return, or give it longer with --tool-timeout "
                                f"(now {self.timeout:g} s)")
        return time.monotonic() - start

    def _result(self, c: Call, res: usercode.Result) -> None:
        if res.timed_out:
            c.kind, c.content = "timeout", error_line(f"{c.name} timed out after {self.timeout:g} s")
            return
        if res.error is not None:
            c.kind, c.content = "raised", error_line(f"{c.name} raised {res.error}")
            return
        try:
            c.content, c.truncated = truncate(render_result(res.value), self.max_chars)
            if self.check is not None:
                self.check(c.content)
        except Exception as e:  # the value's own fault, whatever it raises: a list nested 10^5 deep is a
            # RecursionError in json.dumps, which once ended the run with a traceback
            c.kind, c.truncated, c.content = "result", 0, error_line(f"{c.name} returned what cannot be its result: {e}")

    def abandoned(self) -> int:
        """Calls that timed out and are still running (each holds a thread)."""
        self.abandoned_calls = [(n, d) for n, d in self.abandoned_calls if not d.is_set()]
        return len(self.abandoned_calls)


@dataclass
class Tools:
    """What a run's episodes need of the tools: the --tool ones (an environment's own are read from
    its tools() after reset), the call format, the limits and the runner."""

    fns: dict[str, Tool]  # --tool, by name
    fmt: str  # "hermes" or "llama3-json"
    per_turn: int  # --max-tool-calls-per-turn, 0: the format's own
    max_calls: int  # --max-tool-calls, per episode
    runner: Runner
    env_tools: bool = False  # the environment declares tools(self)
    seconds: float = 0.0  # wall time in Runner.run since the last `metrics`

    def limit(self) -> int:
        return self.per_turn or PER_TURN[self.fmt]


def metrics(calls: list[list[Call]], turns: int, turns_with_calls: int, result_tokens: int,
            seconds: float, abandoned: int) -> dict[str, tuple[float, float]]:
    """A step's tool metrics in (sum, count) form: `calls` holds each played episode's call attempts,
    `turns` the model turns; error kinds and truncation are shares of calls, the rest means per episode."""
    flat = [c for cs in calls for c in cs]
    n, episodes = float(len(flat)), float(len(calls))
    reached = Counter(c.name for c in flat if c.kind in ("", "raised", "timeout", "result"))  # calls that ran their tool
    out = {"tools/calls": (n, episodes),
           "tools/turns_with_calls": (float(turns_with_calls), float(turns)),
           "tools/truncated": (float(sum(c.truncated > 0 for c in flat)), n),
           "tools/result_tokens": (float(result_tokens), episodes),
           "tools/abandoned": (float(abandoned), 1.0),
           "time/tools": (seconds, 1.0)}
    out.update({f"tools/errors/{k}": (float(sum(c.kind == k for c in flat)), n) for k in KINDS})
    out.update({f"tools/calls/{k}": (float(v), episodes) for k, v in sorted(reached.items())})
    return out
