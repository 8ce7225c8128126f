"""Checkpoints: a HF directory (config.json, model.safetensors, tokenizer.json) that
transformers and vLLM load as it is, plus the training state in `trainer_state/`
(optimizer, RNGs, step), written under a temporary name and renamed by rank 0; `--resume`
reads the newest complete one on every rank. Nothing is loaded with pickle: tensors are
safetensors, the rest JSON.

    python -m pytest -q tests/test_train.py -k "resume or kill"
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
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


def save_checkpoint(out: Path, step: int, model, opt, rng, gen: torch.Generator, src) -> Path | None:
    """A HF directory plus the training state (optimizer, RNGs, step) in one atomic rename, by rank 0."""
    names = {id(p): n for n, p in model.named_parameters()}
    tensors = gathered((f"optim/{names[id(p)]}/{k}", v) for p, st in opt.state.items() for k, v in st.items())
    weights = gathered(model.state_dict().items())
    gens = gather([gen.get_state()])  # the engine's sampling generator, every rank's
    if RANK:
        return None
    tensors.update({"rng/engine" + (f"/{r}" if r else ""): g for r, g in enumerate(gens)})  # each rank's engine
    state = {"step": step, "python_rng": rng.getstate(), "world_size": P.WORLD}
    path = out / f"step_{step:06d}"
    M.save(model, path, src, state=weights, extra={f"{STATE}/state.json": json.dumps(state).encode(),
                                                   f"{STATE}/optim_rng.safetensors": st_save(tensors)})
    link = out / "final.tmp"  # `final` points at the newest checkpoint; replaced atomically
    link.unlink(missing_ok=True)
    link.symlink_to(path.name)
    os.replace(link, out / "final")
    return path


def latest_checkpoint(out: Path) -> Path | None:
    done = [p for p in out.glob("step_*") if re.fullmatch(r"step_\d{6}", p.name) and (p / STATE / "state.json").is_file()]
    return max(done, default=None)


def load_training_state(path: Path, model, opt, rng, engine) -> int:
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
    engine.load_weights(model, version=state["step"])
    return state["step"]


def check_resumable(cfg: C.Config, out: Path) -> Path:
    """The checkpoint to resume from; the flags that shape the run must not change."""
    path = latest_checkpoint(out)
    if path is None:
        raise C.ConfigError(f"--resume: no complete checkpoint in {out} (step_NNNNNN/{STATE}/state.json)")
    saved = json.loads((out / "config.json").read_text())
    world = json.loads((path / STATE / "state.json").read_text()).get("world_size", 1)
    if world != P.WORLD:
        raise C.ConfigError(f"--resume: the run in {out} ran on {world} trainer processes, this one on {P.WORLD} "
                            f"(torchrun --nproc_per_node); start a new run with --model {path} instead")
    free = {"steps", "resume", "eval_every", "save_every", "wandb_project", "model"}
    for k, v in json.loads(cfg.to_json()).items():
        if k not in free and saved.get(k) != v:
            raise C.ConfigError(f"--resume: --{k.replace('_', '-')} is {v!r} but the run in {out} used {saved.get(k)!r}")
    return path
