"""The run directory: one run per directory, its checkpoints, resume, and metrics.jsonl.

A checkpoint is a HF directory (config.json, model.safetensors, tokenizer files) that
transformers and vLLM load as it is, plus the training state in `trainer_state/` (optimizer,
RNGs, step), written under a temporary name and renamed by rank 0; `--resume` reads the
newest one that reads whole on every rank (a damaged one is skipped for the one before,
with a warning). Nothing is loaded with pickle: tensors are safetensors, the rest JSON.
`Logger` writes metrics.jsonl (a resume rewrites the kept rows through a temporary file),
the log line, and wandb when asked.

    python -m pytest -q tests/test_train.py tests/test_faults.py -k "resume or kill or damaged"
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import time
import uuid
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch.distributed.tensor import DTensor, distribute_tensor

import config as C
import model as M
import parallel as P
from parallel import RANK, full, gather

STATE = "trainer_state"  # a sub-folder, so vLLM's *.safetensors glob sees only the model

def gathered(named) -> dict[str, torch.Tensor]:
    """(name, tensor) pairs: every rank gathers each FSDP shard in turn, rank 0 alone keeps a CPU copy."""
    return {k: v.detach().cpu() for k, v in ((k, full(v)) for k, v in named) if RANK == 0}


def save_checkpoint(out: Path, step: int, model, opt, rng, gen: torch.Generator, src, scale=None) -> Path | None:
    """A HF directory plus the training state (optimizer, RNGs, step, the fp16 loss scale) in one
    atomic rename, by rank 0."""
    names = {id(p): n for n, p in model.named_parameters()}
    tensors = gathered((f"optim/{names[id(p)]}/{k}", v) for p, st in opt.state.items() for k, v in st.items())
    weights = gathered(model.state_dict().items())
    gens = gather([gen.get_state()])  # the engine's sampling generator, every rank's
    if RANK:
        return None
    tensors.update({"rng/engine" + (f"/{r}" if r else ""): g for r, g in enumerate(gens)})  # each rank's engine
    state = {"step": step, "python_rng": rng.getstate(), "world_size": P.world()}
    if scale is not None and scale.dynamic:
        state["loss_scale"] = [scale.value, scale.good]
    path = out / f"step_{step:06d}"
    try:
        M.save(model, path, src, state=weights, extra={f"{STATE}/state.json": json.dumps(state).encode(),
                                                       f"{STATE}/optim_rng.safetensors": st_save(tensors)})
    except OSError:  # a full or read-only disk mid-write: the torn copy never became step_NNNNNN; free its space
        shutil.rmtree(path.with_name(path.name + ".tmp"), ignore_errors=True)  # M.save's temporary name
        raise
    link = out / "final.tmp"  # `final` points at the newest checkpoint; replaced atomically
    link.unlink(missing_ok=True)
    link.symlink_to(path.name)
    os.replace(link, out / "final")
    return path


def checkpoints(out: Path) -> list[Path]:
    """The run's complete checkpoints, newest first (a torn write leaves only a .tmp folder)."""
    done = [p for p in out.glob("step_*") if re.fullmatch(r"step_\d{6}", p.name) and (p / STATE / "state.json").is_file()]
    return sorted(done, reverse=True)


def damage(path: Path) -> str | None:
    """Why a checkpoint cannot be resumed from, or None: its state JSON and both safetensors files are
    read for their headers, which name every tensor's byte range (a truncated file fails there)."""
    try:
        state = json.loads((path / STATE / "state.json").read_text())
        if not isinstance(state.get("step"), int):
            return f"{STATE}/state.json has no step"
        for f in (path / "model.safetensors", path / STATE / "optim_rng.safetensors"):
            with safe_open(str(f), framework="pt"):
                pass
    except Exception as e:  # json, OSError, safetensors' own errors: all mean "not this one"
        return f"{type(e).__name__}: {e}"
    return None


def load_training_state(path: Path, model, opt, rng, engine, scale=None) -> int:
    state = json.loads((path / STATE / "state.json").read_text())
    tensors = st_load((path / STATE / "optim_rng.safetensors").read_bytes())
    params = dict(model.named_parameters())
    for key, v in sorted(tensors.items()):  # one order on every rank (safetensors' is not fixed)
        if key.startswith("optim/"):
            name, k = key[len("optim/"):].rsplit("/", 1)
            p = params[name]
            if isinstance(p, DTensor) and v.dim():  # this rank's shard, cut like the parameter's
                v = distribute_tensor(v.to(p.device), p.device_mesh, p.placements, src_data_rank=None)
            opt.state[p][k] = v.to(p.device) if v.dim() else v
    engine.gen.set_state(tensors["rng/engine" + (f"/{RANK}" if RANK else "")])
    version, internal, gauss = state["python_rng"]
    rng.setstate((version, tuple(internal), gauss))
    if scale is not None and scale.dynamic and "loss_scale" in state:  # (a run resumed in another dtype starts afresh)
        scale.value, scale.good = state["loss_scale"]
    engine.load_weights(model, version=state["step"])
    return state["step"]


def check_fresh(out: Path) -> None:
    """A new run needs a directory without a run in it: two runs never share one."""
    if out.exists() and not out.is_dir():
        raise C.ConfigError(f"--out-dir {out}: is a file, not a directory")
    if (out / "metrics.jsonl").exists() or any(out.glob("step_*")):
        raise C.ConfigError(f"--out-dir {out} holds a run already: add --resume to continue it, or give another "
                            "--out-dir (or delete that directory to start over)")


def write_config(out: Path, settings: dict) -> None:
    """config.json, written under a temporary name and renamed: a full disk mid-write (a resume
    rewrites it) leaves the old one whole."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "config.json.tmp"
    tmp.write_text(json.dumps(settings, indent=2))
    os.replace(tmp, out / "config.json")


@contextlib.contextmanager
def undone_on_failure(out: Path):
    """A start that fails before its run exists (the engine refuses a flag, a full disk) takes back
    what it wrote, by rank 0: the topmost folder it made (--out-dir itself when it was new), or the
    scratch/ model it added to an existing one, and a torn config.json.tmp. An existing config.json
    is only ever replaced whole (write_config), so --out-dir is left as it was."""
    out = out.absolute()
    made = [p for p in (*reversed(out.parents), out) if not p.exists()][:1]
    made = made or ([] if (out / "scratch").exists() else [out / "scratch"])
    try:
        yield
    except BaseException:  # SystemExit from `fail` and KeyboardInterrupt too
        if RANK == 0:
            for p in made:
                shutil.rmtree(p, ignore_errors=True)
            with contextlib.suppress(OSError):
                (out / "config.json.tmp").unlink(missing_ok=True)
        raise


def check_resumable(cfg: C.Config, out: Path) -> Path:
    """The checkpoint to resume from: the newest complete one that is not damaged (an older one, with
    a warning, when it is); the flags that shape the run must not change."""
    found = checkpoints(out)
    if not found:
        raise C.ConfigError(f"--resume: no complete checkpoint in {out} (step_NNNNNN/{STATE}/state.json)")
    path = None
    for p in found:
        if (why := damage(p)) is None:
            path = p
            break
        P.print0(f"warning: {p} is damaged ({why}); trying the one before it")
    if path is None:
        raise C.ConfigError(f"--resume: every checkpoint in {out} is damaged (the newest: {damage(found[0])})")
    if path != found[0]:
        P.print0(f"warning: resuming from {path.name}, the newest checkpoint that reads whole")
    try:
        saved = json.loads((out / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise C.ConfigError(f"--resume: {out / 'config.json'} is unreadable ({e})") from None
    world = json.loads((path / STATE / "state.json").read_text()).get("world_size", 1)
    if world != P.world():
        raise C.ConfigError(f"--resume: the run in {out} ran on {world} trainer processes, this one on {P.world()} "
                            f"(torchrun --nproc_per_node); start a new run with --model {path} instead")
    if cfg.model != saved.get("model"):
        P.print0(f"note: --model {cfg.model} is not used: a resumed run continues from {path}")
    free = {"steps", "resume", "eval_every", "save_every", "wandb_project", "model", "out_dir"}  # out_dir: any spelling
    for k, v in json.loads(cfg.to_json()).items():
        if k not in free and saved.get(k) != v:
            raise C.ConfigError(f"--resume: --{k.replace('_', '-')} is {v!r} but the run in {out} used {saved.get(k)!r}")
    return path


def kept_metrics(out: Path, step: int) -> list[dict]:
    """metrics.jsonl's rows up to `step` (the later ones are redone). A torn last row (a kill or a
    full disk mid-write) is dropped with a warning; a bad row anywhere else is an error."""
    path = out / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    rows = []
    for i, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i < len(lines) - 1:
                raise C.ConfigError(f"--resume: {path}:{i + 1} is not valid JSON (only a torn last row is repaired)")
            P.print0(f"warning: {path}: dropping its torn last row ({len(line)} bytes)")
    return [r for r in rows if r.get("step", 0) <= step]


def note_changed_rewards(out: Path, hashes: dict[str, str]) -> None:
    saved = json.loads((out / "config.json").read_text()).get("reward_sha256", {})
    for name, h in hashes.items():
        if saved.get(name, h) != h:
            P.print0(f"note: --reward {name}: its file changed since the run started (sha256 {saved[name][:12]} -> "
                   f"{h[:12]}); the resumed run scores with the new one")


# ----------------------------------------------------------------------------- metrics.jsonl and the log line

class Logger:
    """One line per step, metrics.jsonl, and wandb when asked for."""

    def __init__(self, cfg: C.Config, start: int = 0, kept: list[dict] | None = None):
        """kept: on resume, the metrics rows up to the checkpoint (checkpoint.kept_metrics); they are
        written to a temporary file renamed over metrics.jsonl, so a kill never empties the history."""
        self.cfg, self.t0, self.start = cfg, time.time(), start
        out = Path(cfg.out_dir)
        self.rows = list(kept or [])
        self.file = open(os.devnull, "w")
        if RANK == 0:
            tmp = out / "metrics.jsonl.tmp"
            tmp.write_text("".join(json.dumps(r) + "\n" for r in self.rows))
            os.replace(tmp, out / "metrics.jsonl")
            self.file = open(out / "metrics.jsonl", "a")
        self.wandb = None
        if cfg.wandb_project and RANK == 0:
            import wandb

            run_id = out / "wandb_id"  # a resumed run logs into the same wandb run
            if not run_id.is_file():
                run_id.write_text(uuid.uuid4().hex[:8])  # wandb's id alphabet: a-z, 0-9
            self.wandb = wandb.init(project=cfg.wandb_project, config=json.loads(cfg.to_json()), dir=cfg.out_dir,
                                    id=run_id.read_text().strip(), resume="allow")

    def row(self, step: int, metrics: dict) -> None:
        self.rows.append({"step": step, **metrics})
        self.file.write(json.dumps(self.rows[-1]) + "\n")
        self.file.flush()
        if self.wandb:
            self.wandb.log(metrics, step=step)

    def line(self, step: int, m: dict, tokens: int, dt: float) -> None:
        eta = (time.time() - self.t0) / (step - self.start) * (self.cfg.steps - step)
        masked = max((v for k, v in m.items() if k.endswith("/masked_fraction")), default=0.0)  # any mask's
        reward = f"{m['reward']:.3f}" if "reward" in m else "-"
        P.print0(f"step {step}/{self.cfg.steps} | reward {reward} | loss {m.get('loss', math.nan):+.4f} "
               f"| masked {masked:.4f} | mismatch kl {m.get('mismatch/kl', 0.0):.2e} | {tokens / dt:,.0f} tok/s "
               f"| eta {eta:.0f}s" + (f" | loss scale {m['loss_scale']:.0f}" if "loss_scale" in m else ""))
        if self.cfg.async_level and self.cfg.stage == "rl":  # the overlap: wall time below the phases' sum
            r, t = m["time/rollout"], m["time/train"]
            P.print0(f"  async | rollout {r:.2f}s + train {t:.2f}s = {r + t:.2f}s | wall {m['time/step']:.2f}s "
                   f"| age {m.get('staleness/mean', 0.0):.2f}")

    def close(self):
        self.file.close()
        if self.wandb:
            self.wandb.finish()
