"""A run's checkpoints and resume (the directory itself: run/rundir.py; metrics.jsonl: run/runlog.py).

A checkpoint is a HF directory (config.json, model.safetensors, tokenizer files) that
transformers and vLLM load as it is, plus the training state in `trainer_state/` (optimizer,
RNGs, step), written under a temporary name and renamed by rank 0; `--resume` reads the
newest one that reads whole (`whole`: every part checked) and whose steps' rows metrics.jsonl
holds; one that fails either is skipped for the one before, with a warning. Nothing is loaded
with pickle: tensors are safetensors, the rest JSON. metrics.jsonl and the log line: run/runlog.py.

    python -m pytest -q tests/test_train.py tests/test_faults.py -k "resume or kill or damaged"
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import math
import os
import random
from pathlib import Path

import torch
from safetensors import safe_open
from torch.distributed.tensor import DTensor

from config import RENAMED, Config, ConfigError
from engines import ahead
from model import Transformer
from layers import lora, parallel
from layers.parallel import RANK, gather, print0, shard
from run import hfdir, shardfiles
from run.rundir import STATE, checkpoints, floe_config, start_over, trained_steps
from run.runlog import read_rows
from run.shardfiles import MERGED  # noqa: F401  (checkpoint.MERGED: where a LoRA run's merged model lies)
from tasks.textcodec import TextCodec

# a resume may change them; config.json follows (compile: a machine without a C++ compiler resumes a compiled run eager;
# activation checkpointing recomputes the same values, and auto may settle otherwise on another device)
FREE = ("steps", "eval_every", "save_every", "wandb_project", "dist_timeout", "call_timeout", "tool_timeout", "compile", "partial_rollouts", "recompute_kv_on_push",
        "activation_checkpointing", "plan_check", "plan_world")
RECORD = ("reward_sha256", "lora_base", "repeatable")  # config.json's keys that are the run's record, not flags
UNUSED = ("resume", "model", "out_dir")  # a resume ignores them (out_dir: any spelling; model: a LoRA run's base is its record's); config.json keeps the run's


class NothingToDo(Exception):
    """A --resume of a run already at --steps: one line, exit 0, the directory as it was."""


# ----------------------------------------------------------------------------- checkpoints

def save_checkpoint(out: Path, step: int, model, opt, rng, gen: torch.Generator, src, scale=None,
                    final: bool = False, queued: dict | None = None) -> Path | None:
    """A HF directory plus the training state (optimizer, RNGs, step, the fp16 loss scale), written by
    every rank into one temporary directory (shardfiles.write_parts), then, once every rank's part is in, fsynced
    and renamed by rank 0. Under LoRA the adapter in PEFT's files in place of the HF directory, and at
    the `final` step the merged weights as a HF directory in `merged/` as well. `queued`: this rank's batches
    sampled ahead as tensors (engines/ahead.py), into its optimizer file."""
    path = out / f"step_{step:06d}"
    tmp = path.with_name(path.name + ".tmp")
    try:
        made = None
        if RANK == 0:
            try:
                hfdir.new_tmp(path)
                (tmp / STATE).mkdir()
            except OSError as e:
                made = e
        _agree(made, tmp)  # the directory exists before any rank writes into it
        _agree(shardfiles.write_parts(tmp, model, opt, gen, Path(src), final, queued), tmp)
        if RANK:
            return None
        state = {"step": step, "python_rng": rng.getstate(), "world_size": parallel.world()}
        if scale is not None and scale.dynamic:
            state["loss_scale"] = [scale.value, scale.good]
        (tmp / STATE / "state.json").write_text(json.dumps(state))  # last: rundir.checkpoints looks for it
        hfdir.publish_dir(tmp, path)
    except BaseException:  # a full or read-only disk mid-write, a Ctrl-C: the torn copy never became step_NNNNNN
        if RANK == 0:
            with contextlib.suppress(OSError):
                hfdir.remove_path(tmp)  # free its space
        raise
    link = out / "final.tmp"  # `final` points at the newest checkpoint; replaced atomically
    link.unlink(missing_ok=True)  # a stale one: the link itself goes; symlink_to then creates, never follows
    link.symlink_to(path.name)
    os.replace(link, out / "final")
    return path


def _agree(err: OSError | None, tmp: Path) -> None:
    """Every rank's verdict on its part of a save: each raises the first failed rank's error (its own,
    or one naming that rank), so all stop together instead of waiting at the next collective."""
    failed = [r for r, bad in enumerate(gather([err is not None])) if bad]
    if failed:
        raise err or OSError(errno.EIO, f"rank {failed[0]} could not write its part of the checkpoint", str(tmp))


def whole(path: Path, base: tuple | None = None, device: str = "cpu") -> tuple[Transformer, TextCodec]:
    """The checkpoint's model and tokenizer, every part of the checkpoint checked (`_checked`): raises
    naming the first damaged one. One process reads the weights whole, values checked as --model's
    are (hfdir.load); under torchrun the ranks agree on the headers, then each reads only its own rows
    of the weights (hfdir.fill_shards: its verdict on the values is every rank's). A LoRA run's
    checkpoint holds an adapter instead of the HF directory: `base` is (the base model with the run's
    adapters, its tokenizer); the adapter is loaded into it once every part passed (its base is
    filled by check_resumable)."""
    try:
        model, codec = _checked(path, base)
        err = None
    except Exception as e:  # as in `damage`
        err = e
    if parallel.world() > 1 and (failed := [r for r, bad in enumerate(gather([err is not None])) if bad]) and err is None:
        raise ValueError(f"rank {failed[0]} finds it damaged")
    if err is not None:
        raise err
    if parallel.world() > 1 and base is None:
        shard(model)
        hfdir.fill_shards(model, path, {}, device)
    return model, codec


def _checked(path: Path, base: tuple | None) -> tuple[Transformer, TextCodec]:
    """state.json: its step is the directory's, its RNG state one that `random` takes; the HF directory:
    config.json, tokenizer.json and the weights' headers as --model's are checked (hfdir.load_meta: keys,
    shapes; one process reads the values too); each rank's optimizer file: its header (a truncated file
    fails there) holds AdamW state for this model's trained parameters only, in that rank's rows of
    their shapes, and its engine generator; the adapter, under LoRA: the run's (rank, alpha, targets)
    for exactly its layers."""
    state = json.loads((path / STATE / "state.json").read_text())
    step, world = state.get("step"), state.get("world_size", 1)
    if type(step) is not int or path.name != f"step_{step:06d}":
        raise ValueError(f"{STATE}/state.json says step {step!r}, its directory is {path.name}")
    if type(world) is not int or world < 1:
        raise ValueError(f"{STATE}/state.json: world_size {world!r}")
    version, internal, gauss = state["python_rng"]
    if not (gauss is None or isinstance(gauss, float)):
        raise ValueError(f"{STATE}/state.json: python_rng's gauss {gauss!r}")
    random.Random().setstate((version, tuple(internal), gauss))  # a wrong size or type raises
    if "loss_scale" in state:
        value, good = state["loss_scale"]
        if not (isinstance(value, float) and math.isfinite(value) and type(good) is int):
            raise ValueError(f"{STATE}/state.json: loss_scale {state['loss_scale']!r}")
    if base is None:
        model = hfdir.load(path) if parallel.world() == 1 else hfdir.load_meta(path)[0]
        codec = TextCodec.load(path)
    else:
        model, codec = base
    adapter = None if model.lora is None else _adapter(path, model)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters() if p.requires_grad}
    if _legacy(path):  # read as it was written: whole tensors, each rank's generator under its own key
        shardfiles.check_optim(path / STATE / shardfiles.LEGACY, shapes, 0, 1, tuple(_engine_key(r) for r in range(world)))
    for r in range(0 if _legacy(path) else world):
        f = path / STATE / shardfiles.optim_file(r, world)
        shardfiles.check_optim(f, shapes, r, world)
        with safe_open(str(f), framework="pt") as st:  # its batches sampled ahead read back whole
            ahead.decode({k: st.get_tensor(k) for k in st.keys() if k.startswith(ahead.PREFIX)})
    if adapter is not None:
        lora.load_adapter(model, adapter)
    return model, codec


def _adapter(path: Path, model) -> dict[str, torch.Tensor]:
    """A LoRA checkpoint's adapter tensors, checked against the run's adapters (`model.lora`, its layers)."""
    spec, tensors, _ = lora.read_adapter(path)
    if spec != model.lora:
        raise ValueError(f"{lora.CONFIG}: rank {spec.rank}, alpha {spec.alpha:g}, targets {' '.join(spec.targets)}; the run "
                         f"has rank {model.lora.rank}, alpha {model.lora.alpha:g}, targets {' '.join(model.lora.targets)}")
    lora.check_adapter(model, tensors, lora.WEIGHTS)
    return tensors


def damage(path: Path, base: tuple | None = None) -> str | None:
    """Why a checkpoint cannot be resumed from (`whole`), or None."""
    try:
        whole(path, base)
    except Exception as e:  # json, OSError, safetensors' and tokenizers' own errors: all mean "not this one"
        return f"{type(e).__name__}: {e}"
    return None


def load_training_state(path: Path, model, opt, rng, engine, scale=None) -> tuple[int, dict]:
    """The step, optimizer state, RNGs and fp16 loss scale of a checkpoint that `whole` passed, and this
    rank's batches sampled ahead ({step: batch}, engines/ahead.py; empty but under --push-at-decode-step):
    each rank reads its own optimizer file alone (its rows of each AdamW tensor, put in place as FSDP2
    shards them)."""
    state = json.loads((path / STATE / "state.json").read_text())
    params, legacy, queued = dict(model.named_parameters()), _legacy(path), {}
    f = shardfiles.LEGACY if legacy else shardfiles.optim_file(RANK, parallel.world())
    with safe_open(str(path / STATE / f), framework="pt") as st:
        for key in sorted(st.keys()):  # one order on every rank (safetensors' is not fixed)
            if key.startswith(ahead.PREFIX):
                queued[key] = st.get_tensor(key)
            elif key.startswith("optim/"):
                name, k = key[len("optim/"):].rsplit("/", 1)
                p = params[name]
                whole_rows = legacy and isinstance(p, DTensor) and len(st.get_slice(key).get_shape())
                v = st.get_slice(key)[hfdir.rows(p)] if whole_rows else st.get_tensor(key)
                if isinstance(p, DTensor) and v.dim():  # this rank's shard, the rows FSDP2 gives it
                    v = DTensor.from_local(v.to(p.device), p.device_mesh, p.placements, run_check=False,
                                           shape=p.shape, stride=p.stride())
                opt.state[p][k] = v.to(p.device) if v.dim() else v
        engine.gen.set_state(st.get_tensor(_engine_key(RANK) if legacy else "rng/engine"))
    version, internal, gauss = state["python_rng"]
    rng.setstate((version, tuple(internal), gauss))
    if scale is not None and scale.dynamic and "loss_scale" in state:  # (a run resumed in another dtype starts afresh)
        scale.value, scale.good = state["loss_scale"]
    engine.load_weights(model, version=state["step"])
    return state["step"], ahead.decode(queued)


def _legacy(path: Path) -> bool:
    """A checkpoint written before the per-rank optimizer files (shardfiles.LEGACY): still resumed."""
    return (path / STATE / shardfiles.LEGACY).is_file() and not any((path / STATE).glob("optim_rng-*"))


def _engine_key(rank: int) -> str:
    return "rng/engine" + (f"/{rank}" if rank else "")  # a LEGACY file's generator of each rank


# ----------------------------------------------------------------------------- resume

def check_resumable(cfg: Config, out: Path) -> tuple[Path, list[dict], Transformer, TextCodec, Path]:
    """The checkpoint to resume from, with the metrics rows it keeps, its model and tokenizer, and the
    directory the model's weights came from (the checkpoint; under LoRA the run's base): the newest
    that reads whole (`whole`) and whose steps all have their row in metrics.jsonl (the rows are
    fsynced before the checkpoint that covers them; a disk or a copy that lost some falls back to the
    one before, with a warning). The flags that shape the run must not change, nor a LoRA run's base
    (`lora_base`); a run already at --steps has nothing to do (NothingToDo)."""
    if not out.is_dir():
        raise ConfigError(f"--resume: --out-dir {out} does not exist (a new run needs no --resume)")
    found, saved, done = checkpoints(out), floe_config(out), trained_steps(out)
    if not found and saved is None and not done:
        raise ConfigError(f"--resume: {out} holds no floe run (no checkpoint, no floe config.json)")
    if not found:
        raise ConfigError(f"--resume: no complete checkpoint in {out} (its run stopped "
                            f"{f'at step {max(done)}' if done else 'before its first step'}): {start_over(out)}")
    if saved is None:
        raise ConfigError(f"--resume: {out / 'config.json'} is missing or unreadable: the run's flags are unknown")
    saved = same_flags(cfg, saved, out)
    base = lora_base(cfg, saved, out) if cfg.lora_rank else None
    rows, gone = read_rows(out), not (out / "metrics.jsonl").exists()
    have = None if gone else {r["step"] for r in rows}  # no file at all: no row is asked for
    path, model, codec, why = _newest_whole(found, have, out, None if base is None else base[:2], cfg.device)
    if path is None:  # a whole checkpoint that lacks only rows can go on without the history (as when the file is gone)
        way = "" if why[1] is None else (f"delete {out / 'metrics.jsonl'} to resume from {why[1].name} without the "
                                         "history before it, or ")
        raise ConfigError(f"--resume: every checkpoint in {out} is damaged or lacks its metrics rows (the newest: "
                            f"{why[0]}); {way}delete that directory to start over, or give another --out-dir")
    if path != found[0]:
        print0(f"warning: resuming from {path.name}, the newest checkpoint that reads whole")
    if gone:
        print0(f"warning: {out / 'metrics.jsonl'} is gone: resuming from {path.name} without the history before "
                 "it (the new file starts at the next step)")
    world = json.loads((path / STATE / "state.json").read_text()).get("world_size", 1)
    if world != parallel.world():
        raise ConfigError(f"--resume: the run in {out} ran on {world} trainer processes, this one on {parallel.world()} "
                            f"(torchrun --nproc_per_node); start a new run with "
                            + (f"--model {path}" if base is None else f"--model {base[2]} --adapter {path}") + " instead")
    step = int(path.name[5:])  # step_NNNNNN
    if step >= cfg.steps:
        raise NothingToDo(f"nothing to do: the run in {out} is at step {step} and --steps is {cfg.steps}; give "
                          f"--steps above {step} to continue it")
    if base is not None and parallel.world() > 1:  # the base's rows on each rank, beside the checkpoint's whole adapters
        adapters = {n: p.detach() for n, p in model.named_parameters() if not p.is_meta}
        shard(model)
        try:
            hfdir.fill_shards(model, base[2], adapters, cfg.device)
        except ValueError as e:
            raise ConfigError(f"--resume: the run's base model does not load ({e})") from None
    if cfg.model != saved.get("model"):
        print0(f"note: --model {cfg.model} is not used: a resumed run continues from {path}"
                 + (f" on its base {base[2]}" if base else ""))
    return path, [r for r in rows if r["step"] <= step], model, codec, path if base is None else base[2]


def lora_base(cfg: Config, saved: dict, out: Path) -> tuple[Transformer, TextCodec, Path]:
    """A LoRA run's base as its config.json records it (`lora_base`: the directory and its weights'
    sha256), with the run's adapters added (zeros until a checkpoint's are loaded) and its tokenizer.
    A base that is gone or changed stops the resume with one line."""
    rec = saved.get("lora_base")
    if not isinstance(rec, dict) or not isinstance(rec.get("path"), str) or not isinstance(rec.get("sha256"), str):
        raise ConfigError(f"--resume: {out / 'config.json'} records no lora_base (the base model's directory and "
                            "sha256) for its --lora-rank run")
    path = Path(rec["path"])
    try:  # under torchrun its headers alone: each rank reads its rows once a checkpoint is chosen
        model = hfdir.load(path) if parallel.world() == 1 else hfdir.load_meta(path)[0]
        codec = TextCodec.load(path)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"--resume: the run's base model does not load ({e})") from None
    now = gather([_sha256(path) if RANK == 0 else None])[0]  # hashed once, by rank 0: every rank gets its verdict
    if now.startswith("error: "):
        raise ConfigError(f"--resume: the run's base model does not load ({now[7:]})")
    if now != rec["sha256"]:
        raise ConfigError(f"--resume: the base model in {path} changed since the run started (the sha256 of its "
                            f"weights was {rec['sha256'][:12]}, now {now[:12]}); its adapters were trained on the old one")
    args = dataclasses.asdict(model.args)  # a record older than this key: the weights alone are compared
    if changed := [k for k in args if isinstance(rec.get("config"), dict) and rec["config"].get(k) != args[k]]:
        k = changed[0]
        raise ConfigError(f"--resume: the base model in {path} changed since the run started (its config.json's {k} "
                            f"was {json.dumps(rec['config'].get(k))}, now {json.dumps(args[k])}); its adapters were "
                            "trained on the old one")
    lora.add(model, lora.spec_of(cfg), cfg.base_dtype, None if parallel.world() == 1 else cfg.device)
    return model, codec, path


def _sha256(path: Path) -> str:
    try:
        return lora.weights_sha256(path)
    except (OSError, ValueError) as e:
        return f"error: {e}"


def _newest_whole(found: list[Path], have: set[int] | None, out: Path, base: tuple | None = None, device: str = "cpu"):
    """(path, model, codec, None) for the first of `found` that reads whole with its rows in `have` (None: any),
    warning for each one passed over; when none does, (None, None, None, (why the newest failed, the newest
    that read whole but lacked rows, or None))."""
    first = rowless = None
    for p in found:
        try:
            model, codec = whole(p, base, device)
        except Exception as e:  # as in `damage`
            why = f"{p} is damaged ({type(e).__name__}: {e})"
        else:
            lost = [] if have is None else sorted(set(range(1, int(p.name[5:]) + 1)) - have)
            if not lost:
                return p, model, codec, None
            which = f"the row of step {lost[0]}" if len(lost) == 1 else f"the rows of steps {lost[0]}..{lost[-1]}"
            why, rowless = f"{out / 'metrics.jsonl'} lacks {which}, which {p.name} covers", rowless or p
        print0(f"warning: {why}; trying the one before it")
        first = first or why
    return None, None, None, (first, rowless)


def same_flags(cfg: Config, saved: dict, out: Path, free: tuple[str, ...] = ()) -> dict:
    """The run's config.json under today's names; ConfigError naming the first flag that shapes the run
    and differs from it (FREE, UNUSED and `free` may differ)."""
    saved = renamed(saved, out)
    defaults, now = json.loads(Config().to_json()), json.loads(cfg.to_json())
    # the flags other defaults derive from first (--lr's default is LoRA's with --lora-rank): name the cause
    for k, v in sorted(now.items(), key=lambda kv: kv[0] not in ("stage", "lora_rank", "adapter")):
        if k not in FREE + UNUSED + free and saved.get(k, defaults[k]) != v:
            raise ConfigError(f"--resume: --{k.replace('_', '-')} is {v!r} but the run in {out} used {saved.get(k)!r}")
    return saved


def renamed(saved: dict, out: Path) -> dict:
    """A run's config.json under today's flag names (C.RENAMED, old -> new), so a run saved before a
    rename compares its value, not a default, with this one's. A key that is neither a flag, a renamed
    one nor the run's record is refused: what it set would be silently lost."""
    new = {}
    for k, v in saved.items():
        name = RENAMED.get(k, k)
        if name not in Config.__dataclass_fields__ and name not in RECORD:
            raise ConfigError(f"--resume: {out / 'config.json'} sets {k!r}, which is no flag of this floe; "
                                "the run cannot go on as it was started")
        if name in new and new[name] != v:
            raise ConfigError(f"--resume: {out / 'config.json'} sets both {k!r} and {name!r}, differently")
        new[name] = v
    return new


def resumed_config(out: Path, cfg: Config) -> dict | None:
    """config.json on resume: the run's own record (its model, its out_dir) under today's flag names,
    with the flags a resume may change (FREE) as this one gives them; None when none changed (the file
    stays as it is)."""
    saved = json.loads((out / "config.json").read_text())
    now = json.loads(cfg.to_json())
    new = {**renamed(saved, out), **{k: now[k] for k in FREE}}
    return None if new == saved else new


def note_changed_rewards(out: Path, hashes: dict[str, str]) -> None:
    saved = json.loads((out / "config.json").read_text()).get("reward_sha256", {})
    for name, h in hashes.items():
        if saved.get(name, h) != h:
            print0(f"note: --reward {name}: its file changed since the run started (sha256 {saved[name][:12]} -> "
                   f"{h[:12]}); the resumed run scores with the new one")
