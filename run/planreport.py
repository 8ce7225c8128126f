"""What the memory plan tells a user: the plan as a table (`table`, --plan), and whether it fits a
device with, when it does not, the one line of what would (`advice`: each change that alone fits,
tried by re-planning), and the plan for a run's flags: `fit_memory` (run/start.py's `settled` calls it:
--activation-checkpointing auto resolved, a CUDA start over its device stopped with the advice's line)
and `plan_text` (--plan). The arithmetic, from config.json alone, is run/memplan.py's.

    python -m pytest -q tests/test_memplan.py
    python train.py --plan --model checkpoints/reverse-tiny
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from config import Config, ConfigError
from layers import lora
from layers.parallel import LAUNCHED
from model import ModelArgs, TINY
from run import memplan
from run.checkpoint import same_flags
from run.memplan import GIB, Plan, Role, Setup, Shape, plan
from run.rundir import floe_config
from tasks.task import alphabet
from tasks.textcodec import TextCodec


def gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


def describe(p: Plan) -> str:
    a, s = p.shape.args, p.setup
    how = f"LoRA r{s.lora_rank} (base {s.base_dtype})" if s.lora_rank else "full fine-tuning"
    split = f" + {s.inference_gpus} inference" if s.inference_gpus else ""
    engine = f"{s.engine} {s.engine_dtype}" + (f" ({s.vllm_memory:g} of the device)" if s.engine == "vllm" else "")
    return (f"{a.model_type}, {p.shape.params() / 1e9:.2f}B parameters ({a.num_hidden_layers} layers, hidden "
            f"{a.hidden_size}, vocab {a.vocab_size}); {s.world} trainer rank(s){split} on {s.device}, {how}, train "
            f"{s.train_dtype}, engine {engine}, {s.micro_batch_tokens}-token micro-batches, activation checkpointing "
            f"{s.activation_checkpointing}")


def table(p: Plan) -> str:
    """The plan as a markdown table: components by role, then each role's total and start-up peak."""
    names = list(dict.fromkeys(k for r in p.roles for k in r.parts))
    lines = [describe(p), "", "| component | " + " | ".join(r.name for r in p.roles) + " |", "|" + " --- |" * (len(p.roles) + 1)]
    for k in names:
        cells = [gib(r.parts[k]) + " *" * (k in r.computed) if k in r.parts else "-" for r in p.roles]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    other = "blocks" if p.setup.activation_checkpointing == "off" else "off"
    trainer = p.role("trainer rank")
    alt = trainer.total - trainer.parts["activations"] + p.activations[other]
    lines.append("| **total** | " + " | ".join(f"**{gib(r.total)}**" for r in p.roles) + " |")
    lines.append("| start-up peak | " + " | ".join(gib(r.startup) for r in p.roles) + " |")
    lines += ["", f"With activation checkpointing {other} the trainer rank's total would be {gib(alt)} (activations "
              f"{gib(p.activations[other])}). * computed, not measured on this path."]
    return "\n".join(lines)


def need(p: Plan) -> tuple[Role, int]:
    """The role that bounds a device, and its peak (the step's or the start-up's): the trainer or
    inference rank on CUDA, the host on a CPU (its processes are the devices)."""
    roles = [r for r in p.roles if (r.name == "host per node") == (p.setup.device == "cpu")]
    return max(((r, max(r.total, r.startup)) for r in roles), key=lambda rn: rn[1])


def fits(shape: Shape, s: Setup, device_bytes: int, margin: float = 0.0) -> bool:
    return need(plan(shape, s))[1] <= device_bytes * (1 + margin)


def alternatives(s: Setup) -> list[list[tuple[str, Setup]]]:
    """The changes the advice tries, in families, each family in order of preference: more trainer
    ranks, LoRA (then a bf16 base), checkpointing the blocks, smaller micro-batches."""
    r = dataclasses.replace
    ranks = [(f"{n} trainer ranks", r(s, world=n)) for n in (2**k for k in range(1, 11)) if n > s.world]
    lora = ([("--lora-rank 16", r(s, lora_rank=16)), ("--lora-rank 16 --base-dtype bf16", r(s, lora_rank=16, base_dtype="bf16"))]
            if not s.lora_rank else [("--base-dtype bf16", r(s, base_dtype="bf16"))] if s.base_dtype == "fp32" else [])
    blocks = [("--activation-checkpointing blocks", r(s, activation_checkpointing="blocks"))] \
        if s.activation_checkpointing != "blocks" else []
    tokens, t = [], s.micro_batch_tokens // 2
    while t >= 64:
        tokens.append((f"--micro-batch-tokens {t}", r(s, micro_batch_tokens=t)))
        t //= 2
    return [ranks, lora, blocks, tokens]


def advice(shape: Shape, setup: Setup, device_bytes: int, margin: float = 0.0) -> str | None:
    """None when the plan fits `device_bytes` (within `margin`, the plan's error); else one line: the
    role and its need, its largest component, and each change that alone would fit."""
    p = plan(shape, setup)
    role, peak = need(p)
    if peak <= device_bytes * (1 + margin):
        return None
    largest = max(role.parts, key=role.parts.get)
    found = [next((label for label, s in family if fits(shape, s, device_bytes, margin)), None)
             for family in alternatives(p.setup)]
    found = [f for f in found if f]
    what = "its start-up" if peak > role.total else "a step"
    return (f"the memory plan needs {gib(peak)} on a {role.name} at {what}, more than the device's {gib(device_bytes)}; "
            f"the largest part is {largest} ({gib(role.parts[largest])}); "
            + (f"would fit: {'; or '.join(found)}" if found else "no one change fits (more ranks, LoRA, "
               "--activation-checkpointing blocks, a smaller --micro-batch-tokens)"))


# ----------------------------------------------------------------------------- the memory plan

def device_memory(device: str) -> int:
    """One device's bytes; 0 on a CPU, or when no GPU is here (--plan of a CUDA job on a laptop)."""
    return torch.cuda.get_device_properties(0).total_memory if device == "cuda" and torch.cuda.is_available() else 0


def plan_shape(cfg: Config) -> memplan.Shape:
    """The model's shape from config.json alone: --model's, on resume the run's own (its record names
    it; --model is not read then), with --model scratch the tiny model the run would build."""
    if cfg.model == "scratch" and not cfg.resume:
        vocab = TextCodec.tiny(alphabet(cfg)).tok.get_vocab_size()
        return memplan.Shape(ModelArgs(vocab, **TINY))
    saved = floe_config(Path(cfg.out_dir)) if cfg.resume else None
    if cfg.resume and cfg.plan:  # plan what the resume would run: its model, and flags it would not refuse
        if saved is None:
            raise ConfigError(f"--plan --resume: {cfg.out_dir} holds no floe run (no floe config.json) to plan")
        same_flags(cfg, saved, Path(cfg.out_dir), free=("plan",))
    model = (saved or {}).get("model", cfg.model)
    if model == "scratch":
        return memplan.Shape.from_dir(Path(cfg.out_dir) / "scratch")
    return memplan.Shape.from_dir(model)


def plan_setup(cfg: Config, device_bytes: int) -> memplan.Setup:
    """The flags the plan reads; the trainer ranks are --plan-world, or this run's."""
    world = cfg.plan_world if cfg.plan_world is not None else max(1, LAUNCHED - cfg.inference_gpus)
    return memplan.Setup(world, cfg.lora_rank, tuple(cfg.lora_targets), cfg.base_dtype, cfg.train_dtype, cfg.engine,
                         cfg.engine_dtype, cfg.vllm_memory, cfg.device, device_bytes, cfg.inference_gpus,
                         cfg.micro_batch_tokens, cfg.activation_checkpointing,
                         ranks_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", 0)), lora_merged=cfg.lora_merged,
                         teacher=memplan.Shape.from_dir(cfg.teacher) if cfg.teacher not in ("", "base") else None)


def check_lora(shape: memplan.Shape, s: memplan.Setup) -> None:
    """The run's own refusal of its LoRA flags (lora.check_spec), from the shape alone: a plan would count
    a stray target as no adapter, and a rank above a layer's width as adapters that cannot exist."""
    if s.lora_rank:
        mlp = ("gate_proj", "up_proj", "down_proj")
        shapes = {f"model.layers.0.{'mlp' if k in mlp else 'self_attn'}.{k}": (o, i) for k, (i, o) in shape.linears().items()}
        lora.check_spec(shapes, s.lora_rank, s.lora_targets)


def fit_memory(cfg: Config, device_bytes: int) -> Config:
    """--activation-checkpointing auto resolved (memplan.resolve: off on a CPU, so the default job does
    not change; on CUDA blocks when the plan without it passes 80% of the device), and on CUDA with
    --plan-check on a plan over `device_bytes` by more than the plan's error stopped with
    advice's one line. A CPU reads no config.json here: its answer is off, whatever the shape."""
    if cfg.device == "cpu":
        return dataclasses.replace(cfg, activation_checkpointing="off") if cfg.activation_checkpointing == "auto" else cfg
    try:
        shape, setup = plan_shape(cfg), plan_setup(cfg, device_bytes)
        check_lora(shape, setup)  # before the plan, which would otherwise name memory as the fault
        resolved = memplan.resolve(shape, setup)
        why = advice(shape, resolved, device_bytes, memplan.PLAN_ERROR) if device_bytes else None
    except ValueError as e:  # PlanError, or a config.json from_hf refuses
        raise ConfigError(f"the memory plan: {e}") from None
    if why and cfg.plan_check == "on":
        raise ConfigError(f"{why} (--plan prints the plan; --plan-check off starts anyway)")
    return dataclasses.replace(cfg, activation_checkpointing=resolved.activation_checkpointing)


def plan_text(cfg: Config) -> str:
    """--plan: the table of memplan.plan for these flags, and whether it fits this device, or on a
    machine without one each GPU in memplan.DEVICES (a laptop sizes a GPU job)."""
    device_bytes = device_memory(cfg.device)
    try:
        shape, setup = plan_shape(cfg), plan_setup(cfg, device_bytes)
        check_lora(shape, setup)  # a plan of adapters the run would refuse is no plan
        lines = [table(memplan.plan(shape, setup)), ""]
        devices = {"this device": device_bytes} if device_bytes else memplan.DEVICES if cfg.device == "cuda" else {}
        for name, n in devices.items():
            why = advice(shape, dataclasses.replace(setup, device_bytes=n), n, memplan.PLAN_ERROR)
            lines.append(f"{name} ({gib(n)}): " + (why or "fits"))
    except ValueError as e:
        raise ConfigError(f"--plan: {e}") from None
    return "\n".join(lines).rstrip()
