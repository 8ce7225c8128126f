"""Async rollouts: one thread owns the engine and samples batches ahead while the trainer trains.
--async-level a: every batch with exactly the weights the version rule names, so a run repeats
whatever the threads' timing. --max-staleness S: every batch with the newest weights the engine
holds when it starts, never older than the bound allows; the sampler pauses at the bound. One
class has both rules and the decisions; train.py wraps its step in it only for a >= 1 or S >= 1
(with 0 it would make each batch inline, as the synchronous step does itself: tests/test_async.py
holds the two equal).

    python -m pytest -q tests/test_async.py
"""

from __future__ import annotations

import contextlib
import copy
import threading
import time
from dataclasses import dataclass

import torch

from model import Transformer
from engines.torch_engine import Engine
from engines import ahead


def spanning(batch: list) -> float:
    """async/spanning_push: the share of the trained samples whose own tokens (an episode's model turns)
    two or more versions drew: a push landed while they were decoded."""
    def versions(s):
        return {v for v, own in zip(s.versions, s.mask or [True] * len(s.versions)) if own}
    return sum(len(versions(s)) > 1 for s in batch) / max(len(batch), 1)


class _Closed(Exception):
    """close() during a partial rollout's push: the thread leaves the batch it was sampling."""


@dataclass
class RolloutRNG:
    """The rollout side's random state right after one step's batch: what save_checkpoint saves (rng, gen)."""

    rng: object  # random.Random: the prompts
    gen: torch.Generator  # the engine's sampling generator


class AsyncRollouts:
    """--async-level a: the batch trained at step s (1-based: the trainer has made s - 1 optimizer
    steps) is sampled with the weights of exactly version v(s) = max(start, s - 1 - a), version k
    being the weights after k steps. a = 0 is the synchronous loop; with a = 1 the rollout of step
    s + 1 runs while step s trains, and every token is a steps old (fewer in the first a steps
    after a start or a resume).

    Decisions:
    1. One engine holds one version: `publish(model, s)` pushes version s in place once every batch
       that needs an older one is made (the batches up to s + a); the thread starts batch s + a + 1
       only then. No snapshot of the weights is kept, and under FSDP2 the gather inside
       load_weights (collectives) stays on the trainer's thread, in step order, on every rank.
    2. The exact version, not the newest: the thread waits for v(s) and `_make` asserts it, so a
       fixed seed gives the same batches, hence the same metrics, whatever the thread timing. Only
       the rollout side draws prompts (`rng`) and samples (`engine.gen`), one batch after another.
    3. a = 0 makes each batch inline when `get` asks for it: no thread, the synchronous step.
       a >= 1 runs one daemon thread; torch ops release the GIL, so it overlaps on a CPU too. a >= 2
       adds staleness but no speed: the push after step s waits for batch s + a, which needs the
       version before, so each training step still overlaps exactly one rollout.
    4. `lock` keeps generate and load_weights apart. The trainer evaluates between
       `publish(model, s, hold=True)` and `release()`, holding the lock: on the step's own weights,
       with the thread parked, so eval's place in the engine's call order is fixed (whatever an engine does with
       its RNG) and the thread's next batch then overlaps the next training step.
    5. A checkpoint saves the RNG states right after the step's own batch was made (`rng_after`).
       A resume at step k refills the pipeline from the checkpoint's weights: batches k+1..k+a draw
       the same prompts and samples, but from version k instead of k-a..k-1. The resumed run is
       valid, and for a >= 1 not bit-identical to the uninterrupted one (a = 0: exact).
    6. On CUDA the thread samples on its own stream, after the weights pushed on the default one.
       `threads` > 0 sets torch's intra-op threads, for each side, while the thread runs (restored
       at close): train.py gives each half the cores on a CPU, where two full OpenMP teams would
       oversubscribe them (docs/experiments.md "2026-11-30: --async-level 1 on 2 CPU cores").
       An explicit set_num_threads changes how later CPU matmuls split in that process, so a
       later run in the same process may differ from a fresh one in the last bits.
    7. An exception on the thread reaches the trainer at its next `get` or `publish`.
    8. Closing never waits on user code: `stop` (the run's event) abandons a reward or environment
       call the thread is waiting on (usercode.call_all), so hung user code cannot hold up the exit.

    bounded (--max-staleness S, `level` = S): v(s) above is the oldest version batch s may be
    sampled with, not the one it must be. The age of a token is counted from the version that
    sampled it to the version that trains on it, s - 1, queue time included (prime-rl #3313), so
    every age is at most S.
    9. Admission by version counts: the thread starts batch s once the engine holds at least v(s)
       and samples it with whatever newer version it holds then; it never discards, it pauses.
       So at most S batches wait sampled but untrained while step s trains.
    10. `publish` does not wait for the batches ahead: it takes the lock as soon as the batch being
        sampled ends, so the push lands between batches and the next one samples with it. Which
        version a batch gets depends on the threads' timing: the run is valid, not bit-repeatable.
    11. `idle()`: the fractions of the wall time since its last call each side spent waiting (the
        thread: at the bound, on the lock, at a push or done; the trainer: in `get` and `publish`).
    12. Partial rollouts (`partial`, --max-staleness with --partial-rollouts, the default): the push
        does not wait for the batch either. The engine calls `between` before each decode step;
        there, when a push is waiting, the thread lets the lock go, waits until the push (and an eval
        held on it) is over, takes the lock back and decodes on under the new weights, keeping the
        rows' KV cache (PipelineRL's choice; the engine's recompute_kv, --recompute-kv-on-push,
        prefills it again instead: bench/kvdrift.py measures the drift a kept cache leaves, which
        the per-token ratios see, since each log q is the distribution really drawn from). Every token carries the version whose logits drew it, so a sequence
        may hold two or more (async/spanning_push); admission still counts from the version a batch
        starts with, the oldest of its tokens, so the bound holds. A push that raises part way
        leaves the engine torn, and it refuses to sample (torch_engine.refuse_torn): a half-pushed model
        never draws a token.
    13. A fixed landing point (`land_at` = D > 0, --push-at-decode-step): the push of version s
        lands at the D-th decode step of batch s + S (counted over the batch's generate calls), or
        after that batch when it has fewer. The thread parks there until the trainer has pushed s;
        the trainer's `publish(s)` waits until the thread is parked there or the batch is made. So
        batch b starts with version b - 1 - S exactly and takes b - S at its D-th step, whatever the
        threads' timing: a fixed seed gives the same batches, hence the same metrics. The resume is
        exact too: the checkpoint of step k keeps the batches up to k + S, the last that older
        weights sample, and the RNGs right after them (`checkpointed`, engines/ahead.py); a resume puts
        them back (`queue`) and the thread goes on from batch k + S + 1 with version k."""

    def __init__(self, produce, engine: Engine, rng, level: int, start: int, steps: int, threads: int = 0,
                 stop: threading.Event | None = None, bounded: bool = False, partial: bool = False, land_at: int = 0,
                 queue: dict | None = None):
        self.produce, self.engine, self.rng = produce, engine, rng  # produce(step) -> (samples, stats)
        self.stop = stop  # set by close: user code the thread waits on (a reward, an environment) is abandoned at once
        self.level, self.start, self.steps, self.bounded = level, start, steps, bounded
        self.lock = threading.Lock()  # a generate and a weight push never overlap on the engine
        self.cv = threading.Condition()  # guards the fields below
        self.pushed = start  # the engine's version
        self.ready, self.after = dict(queue or {}), {}  # step -> (samples, stats, seconds); step -> RNG states after its batch
        self.made = max(self.ready, default=start)  # the newest batch made (a resume's queue: 13)
        assert sorted(self.ready) == list(range(start + 1, self.made + 1)), f"a queue of steps {sorted(self.ready)} at {start}"
        self.error, self.closed, self.thread, self.held = None, False, None, False
        self.pushing = False  # a push waits for the lock (partial: the thread lets it go between decode steps)
        self.land_at, self.parked = land_at, None  # 13: the decode step a push lands at; the batch parked there
        self.batch, self.decoded = None, 0  # the batch being made and its decode steps so far (13)
        self.waited = {"sampler": 0.0, "trainer": 0.0}  # seconds each side waited since the last idle()
        self.clock = self.waiting = time.perf_counter()  # idle()'s window start; since when the thread waits (None: busy)
        self.threads = None  # torch's intra-op thread count, while the pipeline sets its own
        assert engine.version == start, f"the engine holds version {engine.version}, the run starts at {start}"
        if level > 0:
            if threads:
                self.threads = torch.get_num_threads()
                torch.set_num_threads(threads)
            self.thread = threading.Thread(target=self._loop, name="floe-rollouts", daemon=True)
            if bounded and (partial or land_at):
                engine.between = self._between
            self.thread.start()

    def __enter__(self) -> AsyncRollouts:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def version(self, step: int) -> int:
        """The weights that sample the batch of `step` (bounded: the oldest that may)."""
        return max(self.start, step - 1 - self.level)

    def get(self, step: int):
        """The batch of `step`: (samples, stats, seconds its rollout took)."""
        if self.thread is None:
            self._make(step)
        t = time.perf_counter()
        self._wait(lambda: step in self.ready)
        with self.cv:
            self.waited["trainer"] += time.perf_counter() - t
            return self.ready.pop(step)

    def publish(self, model: Transformer, step: int, hold: bool = False) -> None:
        """Push the weights after `step` as version `step` once no batch needs older ones (bounded:
        once the batch being sampled ends). hold: no batch samples until `release()` (the trainer
        evaluates them first)."""
        t = time.perf_counter()
        if not self.bounded:
            self._wait(lambda: self.made >= min(step + self.level, self.steps))
        elif self.land_at:  # 13: the thread at batch step + S's landing point, or past that batch
            self._wait(lambda: self.parked == step + self.level or self.made >= min(step + self.level, self.steps))
        with self.cv:
            self.pushing = True
        self.lock.acquire()
        self.held = True
        with self.cv:
            self.waited["trainer"] += time.perf_counter() - t
        try:
            self.engine.load_weights(model, version=step)
        finally:
            with self.cv:
                self.after.pop(step - 1, None)
            if not hold:
                self.release()

    def release(self) -> None:
        """Let the thread sample with the version just published."""
        with self.cv:
            self.pushed, self.pushing = self.engine.version, False
            self.cv.notify_all()
        if self.held:
            self.held = False
            self.lock.release()

    def idle(self) -> dict[str, float]:
        """async/sampler_idle and async/trainer_idle: the fractions of the wall time since the last
        call (a step's, called once a step) that each side spent waiting."""
        with self.cv:
            now = time.perf_counter()
            if self.waiting is not None:  # the thread waits now: its wait so far counts in this window
                self.waited["sampler"] += now - self.waiting
                self.waiting = now
            wall, self.clock = max(now - self.clock, 1e-9), now
            out = {f"async/{k}_idle": min(1.0, v / wall) for k, v in self.waited.items()}
            self.waited = dict.fromkeys(self.waited, 0.0)
        return out

    def ages(self, m: dict) -> dict[str, float]:
        """staleness/max, read off the step's shares of each age 0..S (layers/terms.token_stats). Shares
        that do not cover every token mean one older than S trained: the sampler broke its bound, and
        the run stops rather than train on."""
        fracs = [m[f"staleness/frac/{k}"] for k in range(self.level + 1) if f"staleness/frac/{k}" in m]
        if not fracs:  # nothing trained
            return {}
        if abs(sum(fracs) - 1) > 1e-6:
            raise RuntimeError(f"--max-staleness {self.level}: {1 - sum(fracs):.3%} of the tokens trained are older "
                               "than the bound")
        return {"staleness/max": float(max(k for k, f in enumerate(fracs) if f > 0))}

    def rng_after(self, step: int) -> RolloutRNG:
        """Copies of the prompt and sampling RNGs as they were right after the batch of `step`."""
        with self.cv:
            py, gen = self.after[step]
        rng = copy.copy(self.rng)
        rng.setstate(py)
        g = torch.Generator(device=self.engine.gen.device)
        g.set_state(gen)
        return RolloutRNG(rng, g)

    def checkpointed(self, step: int) -> tuple[RolloutRNG, dict]:
        """What the checkpoint of `step` keeps of the rollout side: the RNGs, and (13) the batches sampled
        ahead as tensors (engines/ahead.py), waiting until the last one older weights sample is made; without
        a landing point, or where a batch is not JSON, no batches, and a resume refills them (5)."""
        last = min(step + self.level, self.steps)
        if self.land_at and self.bounded:
            self._wait(lambda: self.made >= last)
            with self.cv:
                tensors = ahead.encode({b: self.ready[b] for b in range(step + 1, last + 1)})
            if tensors is not None:
                return self.rng_after(last), tensors
            print(f"note: the checkpoint of step {step} holds no batch sampled ahead (a prompt's columns are not "
                  "JSON): a resume samples them again from its weights, a valid run but not this one", flush=True)
        return self.rng_after(step), {}

    def close(self) -> None:
        """Stop the thread after the batch it is making, if any; give torch its threads back."""
        with self.cv:
            self.closed = True
            self.cv.notify_all()
        if self.held:  # an eval that raised between publish(hold=True) and release()
            self.release()
        if self.stop is not None:
            self.stop.set()
        if self.thread is not None:
            self.thread.join()
            self.engine.between = None
        if self.threads is not None:
            torch.set_num_threads(self.threads)

    def _make(self, step: int, side: torch.cuda.Stream | None = None) -> None:
        with self.lock:
            self._busy()
            if self.closed:  # bounded: close() let the lock go while the thread waited on it
                return
            if side is not None:  # after the weights the trainer pushed on its stream (bounded: maybe just now)
                side.wait_stream(torch.cuda.default_stream(side.device))
            v, oldest = self.engine.version, self.version(step)
            assert v == oldest or self.bounded and oldest <= v < step, \
                f"step {step} needs version {oldest}{' or newer' * self.bounded}, the engine holds {v}"
            t = time.perf_counter()
            self.batch, self.decoded = step, 0
            samples, stats = self.produce(step)  # a push lands between decode steps (partial) or waits for the lock
            seconds = time.perf_counter() - t
            after = (self.rng.getstate(), self.engine.gen.get_state())
        with self.cv:
            self.ready[step], self.after[step], self.made = (samples, stats, seconds), after, step
            self.waiting = time.perf_counter()
            self.cv.notify_all()

    def _between(self) -> None:
        """The engine between two decode steps on the thread (partial rollouts): a waiting push lands
        here (13: the push due, at its fixed decode step)."""
        if threading.current_thread() is not self.thread:  # an eval's generate: the push's own
            return
        if self.land_at:
            self.decoded += 1
            due = self.batch - self.level  # the version this batch takes at its landing point
            if self.decoded != self.land_at or due <= self.pushed:
                return
            with self.cv:
                self.parked, self.waiting = self.batch, time.perf_counter()
                self.cv.notify_all()
            done = lambda: self.pushed >= due and not self.pushing or self.closed  # noqa: E731
        elif self.pushing:
            with self.cv:
                self.waiting = time.perf_counter()
            done = lambda: not self.pushing or self.closed  # noqa: E731
        else:
            return
        self.lock.release()
        with self.cv:
            self.cv.wait_for(done)
            self.parked = None
        self.lock.acquire()
        self._busy()
        if self.closed:
            raise _Closed  # the batch is abandoned: the run is over
        dev = self.engine.gen.device
        if dev.type == "cuda":  # the thread's own stream, after the weights pushed on the default one
            torch.cuda.current_stream(dev).wait_stream(torch.cuda.default_stream(dev))

    def _busy(self) -> None:
        """The thread's wait (at the bound, or for the lock) ends here."""
        with self.cv:
            if self.waiting is not None and self.thread is not None:
                self.waited["sampler"] += time.perf_counter() - self.waiting
            self.waiting = None

    def _loop(self) -> None:
        dev = self.engine.gen.device
        side = torch.cuda.Stream(dev) if dev.type == "cuda" else None
        try:
            for step in range(self.made + 1, self.steps + 1):  # a resume's queue holds the first ones
                with self.cv:
                    self.cv.wait_for(lambda: self.closed or self.pushed >= self.version(step))
                    if self.closed:
                        return
                with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                    self._make(step, side)
        except _Closed:
            return
        except BaseException as e:  # handed to the trainer
            with self.cv:
                self.error = e
                self.cv.notify_all()

    def _wait(self, done) -> None:
        with self.cv:
            self.cv.wait_for(lambda: done() or self.error is not None)
            if not done():
                raise self.error
