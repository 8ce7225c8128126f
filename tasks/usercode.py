"""Calling code floe did not write (reward functions, environments): loaded by path, run with a
timeout, and never able to take the run down, hang it, or change floe's own data.

User code can hang, raise, exit or lie. Every call goes through `call` (one) or `call_all` (a
batch at once):
1. Each call runs on a daemon worker thread of its own, the calls of a batch all at once, and is
   waited for at most `timeout` seconds (less when the run shuts down meanwhile: `stop`).
   A call that does not return by then is abandoned: the run goes on without it, and a daemon
   thread never keeps the process from exiting. (A worker process could also be killed, but it
   would have to pickle every environment and lose the user's in-process state; Python cannot
   kill a thread, so an abandoned call may still run in the background until the run ends.)
   Workers are kept for later calls (`_Workers`): starting a thread waits for it to be
   scheduled, which a step's dozens of reward and environment calls would pay every step. A
   worker takes a new call only once its last one returned, so a hung call holds its worker
   and no other call waits behind it.
2. Whatever the call raises, `SystemExit` and `KeyboardInterrupt` included, is that code's error:
   it comes back as a `Result` with the exception's one-line description, never as floe's own
   exit. `os._exit` ends the process from any thread and cannot be caught in-process.
3. The caller hands copies (`copied`) of anything floe keeps, so user code that mutates its
   arguments changes nothing floe trains on.
4. What comes back is checked by one rule wherever it is a number (`number`: any real number,
   numpy's scalars and 0-d arrays or tensors included, bool as 0 or 1) or a yes/no (`flag`: a
   bool, numpy's too); anything else is refused, naming its type.
5. A thread user code started and left running (not a daemon) would keep Python from exiting
   after the run's last line: `main_then_leave` says so once and leaves without waiting for it.

Loading (`load`): `path/to/file.py:name` or `module:name`. A file is imported like any module:
its top-level code runs at start-up (and again on `--resume`); a `SystemExit` there is reported
as that file's error.

This module is layer 0: the standard library alone.
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import numbers
import os
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable


class LoadError(ValueError):
    """A spec that does not load: the message is one line naming it."""


@dataclass
class Result:
    """One call's outcome: `value` when it returned, else `error` (its one line) or `timed_out`."""

    value: Any = None
    error: str | None = None
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None and not self.timed_out


def describe(e: BaseException) -> str:
    """An exception as one line: its type and message (SystemExit: its code)."""
    if isinstance(e, SystemExit):
        return f"SystemExit({e.code!r}) (user code may not exit the run)"
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


class _Call:
    """One call handed to a worker: `done` is set when `result` holds what it returned or raised."""

    def __init__(self, fn: Callable[[], Any]):
        self.fn, self.result, self.done = fn, Result(timed_out=True), threading.Event()

    def run(self) -> None:
        try:
            self.result = Result(value=self.fn())
        except BaseException as e:  # SystemExit and KeyboardInterrupt too: the user's code's error
            self.result = Result(error=describe(e))
        finally:
            self.done.set()


class _Workers:
    """Daemon threads that run calls, kept between batches. A call goes to an idle worker, or to
    a new one when none is idle (a worker still inside an abandoned call is not idle)."""

    def __init__(self):
        self.jobs: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        self.lock, self.idle, self.started = threading.Lock(), 0, 0

    def submit(self, c: _Call) -> None:
        with self.lock:
            if self.idle:
                self.idle -= 1
            else:
                self.started += 1
                threading.Thread(target=self._work, daemon=True, name=f"floe-user-{self.started}").start()
        self.jobs.put(c)

    def _work(self) -> None:
        while True:
            self.jobs.get().run()
            with self.lock:
                self.idle += 1


_WORKERS = _Workers()


def call_all(calls: list[Callable[[], Any]], timeout: float, stop: threading.Event | None = None) -> list[Result]:
    """Run every zero-argument callable on a daemon worker thread of its own, all at once, and
    wait for each until `timeout` seconds after the start, or until `stop` is set (the run is
    shutting down); a call still running then is abandoned (timed out)."""
    pending = [_Call(fn) for fn in calls]
    for c in pending:
        _WORKERS.submit(c)
    deadline = time.monotonic() + timeout
    for c in pending:
        while not c.done.is_set() and not (stop is not None and stop.is_set()):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            c.done.wait(left if stop is None else min(left, 0.05))
    # a call still running keeps its timed-out Result even if it finishes later: nobody reads it then
    return [c.result if c.done.is_set() else Result(timed_out=True) for c in pending]


ATOMS = (str, int, float, bool, bytes, type(None))


def copied(x: Any) -> Any:
    """What `copy.deepcopy` gives, for the arguments floe hands user code: lists, tuples and dicts
    are rebuilt, strings and numbers shared (they cannot change), anything else deep-copied. A
    step's reward calls copy every completion's ids and conversation, where deepcopy's per-object
    bookkeeping is the larger cost."""
    t = type(x)
    if t in ATOMS:
        return x
    if t is list:
        return list(x) if all(type(v) in ATOMS for v in x) else [copied(v) for v in x]
    if t is dict:
        return {k: copied(v) for k, v in x.items()}
    if t is tuple:
        return tuple(copied(v) for v in x)
    return copy.deepcopy(x)


def call(fn: Callable[[], Any], timeout: float) -> Result:
    return call_all([fn], timeout)[0]


def _scalar(value: Any) -> Any:
    """A 0-d numpy array or torch tensor (or a numpy scalar) as the Python value it holds."""
    if not isinstance(value, (numbers.Real, str)) and getattr(value, "ndim", None) == 0 and callable(getattr(value, "item", None)):
        return value.item()
    return value


def number(value: Any) -> float:
    """User code's number as a float: any real number (int, float, Fraction, numpy's scalars; bool as 0
    or 1) or a 0-d array or tensor holding one. TypeError naming what it got otherwise."""
    value = _scalar(value)
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(f"{type(value).__name__} {str(value)[:40]!r} is not a number")


def flag(value: Any) -> bool:
    """User code's yes/no: a bool (numpy's, or a 0-d tensor of one). TypeError naming what it got otherwise
    (bool("no") would be True)."""
    value = _scalar(value)
    if isinstance(value, bool):
        return value
    raise TypeError(f"{type(value).__name__} {str(value)[:40]!r} is not a bool")


def strays() -> list[threading.Thread]:
    """Threads still running that Python's exit would wait for (not daemons): user code's."""
    return [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon and t.is_alive()]


def main_then_leave(main: Callable[[], Any]) -> None:
    """Run `main` to its end; if threads user code started are still running then, say so once and end
    the process with main's exit status without waiting for them (flushed, then os._exit: Python's own
    exit would join them forever). With none left, exit as usual."""
    try:
        main()
        code: Any = 0
    except SystemExit as e:
        code = e.code
    except BaseException:
        if not strays():
            raise
        traceback.print_exc()
        code = 1
    deadline = time.monotonic() + 2.0  # a thread winding down on its own is let finish
    for t in strays():
        t.join(max(0.0, deadline - time.monotonic()))
    if left := strays():
        print(f"note: {len(left)} thread(s) that user code started are still running ({', '.join(t.name for t in left[:3])}); "
              "floe exits without waiting for them", flush=True)
        if isinstance(code, str):
            print(code, file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code if isinstance(code, int) else int(code is not None))
    raise SystemExit(code)


def _hung_import(line: str) -> None:
    """A user file still importing after its timeout: the start stops here, before its first byte is
    written (the import runs on the main thread, as Python's own would, and cannot be abandoned)."""
    print(f"floe: error: {line}", file=sys.stderr, flush=True)
    os._exit(2)


def load(spec: str, flag: str, builtin: dict[str, Any] | None = None, kind: str = "function",
         timeout: float = 60.0) -> tuple[Any, Path | None]:
    """The object `spec` names (a built-in name, `path/to/file.py:name` or `module:name`) and the
    file it came from (None for a built-in); LoadError (one line, naming `flag`) when it does not load;
    an import still running after `timeout` seconds (--call-timeout) ends the process with one line, exit 2."""
    builtin = builtin or {}
    if spec in builtin:
        return builtin[spec], None
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        names = f"a built-in ({', '.join(builtin)}) nor " if builtin else ""
        raise LoadError(f"{flag} {spec!r}: not {names}path/to/file.py:name or module:name")
    path: Path | None = Path(where)
    timer = threading.Timer(timeout, _hung_import, (f"{flag} {spec}: importing {where} did not finish within "
                                                    f"--call-timeout {timeout:g} s (a file that hangs at import)",))
    timer.daemon = True
    timer.start()
    try:
        if where.endswith(".py") or "/" in where:
            if not path.is_file():
                raise LoadError(f"{flag} {spec}: no such file {path}")
            mod_spec = importlib.util.spec_from_file_location(f"floe_user_{path.stem}", path)
            module = importlib.util.module_from_spec(mod_spec)
            mod_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
            path = Path(module.__file__) if getattr(module, "__file__", None) else None
    except LoadError:
        raise
    except BaseException as e:  # the user's file failed to import, or exited while importing: one line
        raise LoadError(f"{flag} {spec}: importing {where} raised {describe(e)}") from None
    finally:
        timer.cancel()
    obj = getattr(module, name, None)
    if obj is None:
        raise LoadError(f"{flag} {spec}: {where} has no {kind} {name!r}")
    return obj, path
