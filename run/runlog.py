"""A run's log: the line printed per step, metrics.jsonl (one JSON row per step and eval), wandb
when asked for, the end summary, the graphs torch.compile built (`Graphs`), and the lines a run
that cannot go on stops with. A resume reads
the rows back (`read_rows`) and keeps those its checkpoint covers; `Logger` rewrites them through a
temporary file, so a kill never empties the history.

    python -m pytest -q tests/test_train.py tests/test_faults.py -k "resume or metrics"
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
import uuid
from pathlib import Path

import torch

from config import Config, ConfigError
from layers.parallel import RANK, print0
from run.rundir import create_new, publish, regular, row_step, way_on, write_file


def read_rows(out: Path) -> list[dict]:
    """metrics.jsonl's rows. A torn last row (a kill or a full disk mid-write: not JSON) is dropped
    with a warning; any other line that is not a row (a JSON object with an integer step), or a row
    out of step order or repeated, is an error."""
    path = out / "metrics.jsonl"
    lines = path.read_text(errors="replace").splitlines() if path.is_file() else []
    rows, last = [], -1
    for i, line in enumerate(lines):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if i < len(lines) - 1:
                raise ConfigError(f"--resume: {path}:{i + 1} is not valid JSON (only a torn last row is repaired)")
            print0(f"warning: {path}: dropping its torn last row ({len(line)} bytes)")
            continue
        if row_step(row) is None:
            raise ConfigError(f"--resume: {path}:{i + 1} is not a metrics row (a JSON object with an integer "
                                f"step): {line[:60]}")
        if row["step"] <= last:  # floe writes each step once, in order: the file was edited or pasted together
            raise ConfigError(f"--resume: {path}:{i + 1} is step {row['step']} after step {last} (rows are in step "
                                "order, one per step)")
        rows.append(row)
        last = row["step"]
    return rows



class Logger:
    """One line per step, metrics.jsonl, and wandb when asked for."""

    def __init__(self, cfg: Config, start: int = 0, kept: list[dict] | None = None):
        """kept: on resume, the metrics rows up to the checkpoint (check_resumable); they are written
        to a temporary file renamed over metrics.jsonl, so a kill never empties the history, and
        the rows that follow go on through the same descriptor (the file that was renamed into place)."""
        self.cfg, self.t0, self.start = cfg, time.time(), start
        out = Path(cfg.out_dir)
        self.rows = list(kept or [])
        self.file = open(os.devnull, "w")
        if RANK == 0:
            self.file = create_new(out / "metrics.jsonl.tmp")
            self.file.write("".join(json.dumps(r) + "\n" for r in self.rows))
            publish(self.file, out / "metrics.jsonl")
        self.wandb = None
        if cfg.wandb_project and RANK == 0:
            import wandb

            run_id = out / "wandb_id"  # a resumed run logs into the same wandb run; a new one (started over) not
            ident = run_id.read_text().strip() if kept is not None and regular(run_id) else ""
            if not ident:
                ident = uuid.uuid4().hex[:8]  # wandb's id alphabet: a-z, 0-9
                write_file(run_id, ident)
            self.wandb = wandb.init(project=cfg.wandb_project, config=json.loads(cfg.to_json()), dir=cfg.out_dir,
                                    id=ident, resume="allow")

    def row(self, step: int, metrics: dict) -> None:
        self.rows.append({"step": step, **metrics})
        self.file.write(json.dumps(self.rows[-1]) + "\n")
        self.file.flush()
        if self.wandb:
            self.wandb.log(metrics, step=step)

    def sync(self) -> None:
        """The rows on disk, before the checkpoint that covers them (rank 0): a power cut then never
        leaves a checkpoint whose rows are gone, which a resume would not redo."""
        if RANK == 0:
            self.file.flush()
            os.fsync(self.file.fileno())

    def line(self, step: int, m: dict, tokens: int, dt: float) -> None:
        eta = (time.time() - self.t0) / (step - self.start) * (self.cfg.steps - step)
        masked = max((v for k, v in m.items() if k.endswith("/masked_fraction")), default=0.0)  # any mask's
        reward = f"{m['reward']:.3f}" if "reward" in m else "-"
        loss = "skipped (nothing to train)" if m.get("skipped/empty_step") else f"loss {m.get('loss', math.nan):+.4f}"
        print0(f"step {step}/{self.cfg.steps} | reward {reward} | {loss} "
               f"| masked {masked:.4f} | mismatch kl {m.get('mismatch/kl', 0.0):.2e} | {tokens / dt:,.0f} tok/s "
               f"| eta {eta:.0f}s" + (f" | loss scale {m['loss_scale']:.0f}" if "loss_scale" in m else ""))
        if (self.cfg.async_level or self.cfg.max_staleness) and self.cfg.stage == "rl":  # the overlap: wall below the sum
            r, t = m["time/rollout"], m["time/train"]
            print0(f"  async | rollout {r:.2f}s + train {t:.2f}s = {r + t:.2f}s | wall {m['time/step']:.2f}s "
                   f"| age {m.get('staleness/mean', 0.0):.2f}")

    def summary(self, extra: dict | None = None) -> dict:
        """The end summary: eval reward at the start and the end, total time, peak memory, and
        `extra` (the regions that ran compiled)."""
        evals = [r for r in self.rows if "eval/reward" in r]
        peak = (torch.cuda.max_memory_allocated() if self.cfg.device == "cuda"
                else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        summary = {"steps": self.cfg.steps, "time_s": round(time.time() - self.t0, 1),
                   "peak_memory_gib": round(peak / 2**30, 3)}
        if evals:
            summary.update({"eval/reward@0": evals[0]["eval/reward"], "eval/reward": evals[-1]["eval/reward"]})
        summary.update(extra or {})
        print0("summary " + json.dumps(summary))
        return summary

    def close(self):
        self.file.close()
        if self.wandb:
            self.wandb.finish()


# ----------------------------------------------------------------------------- what torch.compile built

class Graphs:
    """torch.compile's graphs as a measured quantity, under --compile on: each row's
    `compile/graphs` (built since the run began: Dynamo's count, every region and thread) and
    `compile/new_graphs` (since the last row). Steps 1..WARMUP and the step-0 eval are warm-up;
    after it a new graph is one warning line naming the function and the guard that failed
    (Dynamo's record of guard failures). `summary` names the compiled regions that ran
    (`compile/regions`): a region ran compiled when its function holds a graph."""

    WARMUP = 2

    def __init__(self, cfg: Config, regions: dict):
        self.on = cfg.compile == "on"
        self.regions = {name: fn.__code__ for name, fn in regions.items()}  # name -> the compiled function's code
        self.base = self._count() if self.on else 0  # graphs an earlier run in this process built
        self.total, self.seen = 0, {}  # graphs at the last row; code -> guard failures already read
        if self.on:
            self._failures()  # an earlier run's guard failures are not this run's

    @staticmethod
    def _count() -> int:
        from torch._dynamo.utils import counters
        return counters["stats"]["unique_graphs"]

    def _failures(self) -> list:
        """The guard failures Dynamo recorded since the last call: (code, reason) pairs."""
        from torch._dynamo.utils import guard_failures
        out = []
        for code, reasons in list(guard_failures.items()):
            out += [(code, r) for r in reasons[self.seen.get(code, 0):]]
            self.seen[code] = len(reasons)
        return out

    def row(self) -> dict:
        if not self.on:
            return {}
        total = self._count() - self.base
        new, self.total = total - self.total, total
        return {"compile/graphs": total, "compile/new_graphs": new}

    def check(self, step: int, m: dict) -> list[str]:
        """The warning for a graph built after warm-up, with the guard failures behind it."""
        if not self.on:
            return []
        failed, new = self._failures(), m.get("compile/new_graphs", 0)
        if step <= self.WARMUP or not new:
            return []
        why = "; ".join(f"{code.co_qualname} ({Path(code.co_filename).name}:{code.co_firstlineno}) recompiled: {r}"
                        for code, r in failed[-2:]) or "no guard failed (a function compiled for the first time)"
        return [f"warning: step {step}: torch.compile built {new} new graph{'s' * (new > 1)} after warm-up "
                f"(steps 1-{self.WARMUP} and the step-0 eval), so this step paid a compile: {why}"]

    def summary(self) -> dict:
        if not self.on:
            return {}
        from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
        return {"compile/regions": [name for name, code in self.regions.items() if _debug_get_cache_entry_list(code)]}


# ----------------------------------------------------------------------------- the lines a run warns and stops with

class Stalls:
    """The two signs that a run cannot learn, read from each step's metrics; each is one warning
    line when it starts to hold, and again only after it has cleared: most completions cut at
    --max-new-tokens (`truncated_fraction` over one half: their rewards score cut-off text), and
    every group's rewards equal for EQUAL_STEPS steps in a row (`groups/equal_rewards` 1: every
    advantage is zero)."""

    EQUAL_STEPS = 3

    def __init__(self, cfg: Config):
        self.cfg, self.cut, self.equal = cfg, False, 0

    def check(self, step: int, m: dict) -> list[str]:
        out, cut = [], m.get("truncated_fraction", 0.0) > 0.5
        if cut and not self.cut:
            what = "episodes ended on a turn cut" if self.cfg.env or self.cfg.tool else "completions were cut"
            out.append(f"warning: step {step}: {m['truncated_fraction']:.0%} of the {what} at --max-new-tokens "
                       f"{self.cfg.max_new_tokens} (truncated_fraction), so their rewards score cut-off text; "
                       "raise --max-new-tokens")
        self.cut = cut
        self.equal = self.equal + 1 if m.get("groups/equal_rewards") == 1.0 else 0
        if self.equal == self.EQUAL_STEPS:
            why = ("the cut completions above are the likely cause" if cut else "give the groups a spread: a task the "
                   "model sometimes solves, a reward with partial credit, a larger --group-size or --temperature")
            out.append(f"warning: steps {step - self.EQUAL_STEPS + 1}-{step}: every group's {self.cfg.group_size} rewards "
                       f"were equal (reward {m.get('reward', 0.0):.3f}, groups/equal_rewards 1.00), so every advantage "
                       f"is zero and nothing is learned from them; {why}")
        return out


def nonfinite_cause(batch: list, m: dict) -> str:
    """What made a step's gradient non-finite, for the line that stops the run."""
    if any(not math.isfinite(s.advantage) for s in batch):
        top = max((abs(s.reward) for s in batch), default=0.0)
        return f"non-finite advantages (rewards up to {top:.3g} overflow the group statistics)"
    if not math.isfinite(m.get("loss", 0.0)):
        return "a non-finite loss (check --adv-tau, --kl-coeff and the sampler's log-probs)"
    return "a non-finite gradient norm"


def idle_cause(batch: list, m: dict) -> str:
    """Why a step trained nothing (no sample, or a non-finite update), for the lines that stop a run."""
    if batch:
        return f"skipped for {nonfinite_cause(batch, m)}"
    counts = f"skipped/reward_error {m.get('skipped/reward_error', 0):.2f}, skipped/too_long {m.get('skipped/too_long', 0):.2f}"
    if m.get("skipped/too_long") == 1.0:
        return f"every prompt is longer than the context ({counts})"
    if m.get("skipped/env_error") == 1.0:
        return "every episode failed (skipped/env_error 1.00; see the warnings above)"
    return f"every reward call raised or returned None/NaN ({counts})"


# ----------------------------------------------------------------------------- the lines a run stops with

def fail(e: Exception, code: int, every_rank: bool = False):
    """One line naming what was wrong, and the exit status: 2 bad input, 1 a step that cannot go on. A
    wait at a collective that ran out (--dist-timeout) is said by every rank that waited (`every_rank`):
    rank 0 may be the one that stopped."""
    (print if every_rank else print0)(f"floe: error: {e}", file=sys.stderr)  # stderr: line-buffered
    raise SystemExit(code) from None


class Interrupted(Exception):
    """Ctrl-C (SIGINT) in the loop, at `step`: main says where a --resume goes on from, and exits 130."""

    def __init__(self, step: int):
        self.step = step


def interrupted(out: Path, step: int | None):
    """A Ctrl-C's one line in place of a traceback, and exit 130 (the shell's for SIGINT)."""
    print0(f"floe: interrupted {f'at step {step}' if step else 'at start-up'}; {way_on(out)}", file=sys.stderr)
    raise SystemExit(130) from None
