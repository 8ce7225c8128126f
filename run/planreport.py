"""What the memory plan tells a user: the plan as a table (`table`, --plan), and whether it fits a
device with, when it does not, the one line of what would (`advice`: each change that alone fits,
tried by re-planning). The arithmetic, from config.json alone, is run/memplan.py's; run/start.py
prints the table for --plan and stops a CUDA start with the advice's line.

    python -m pytest -q tests/test_memplan.py
    python train.py --plan --model checkpoints/reverse-tiny
"""

from __future__ import annotations

import dataclasses

from run.memplan import GIB, Plan, Role, Setup, Shape, plan


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
