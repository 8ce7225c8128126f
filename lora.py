"""LoRA (--lora-rank r): the adapter's shape and its files in PEFT's format.

W x + (alpha / r) B A x for each adapted linear layer: A (r, in) and B (out, r) are trained in
fp32, the base W stays frozen. An adapter on disk is PEFT's directory (adapter_config.json and
adapter_model.safetensors with PEFT's names), so peft, transformers and vLLM load it as it is.

    python train.py --lora-rank 8 --lora-alpha 16 --lr 1e-3
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # every linear of a block
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM 0.32 accepts
PREFIX = "base_model.model."  # PEFT's prefix before the model's own parameter names
CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


@dataclass(frozen=True)
class LoRASpec:
    """Which layers carry an adapter, and its rank and alpha."""

    rank: int
    alpha: float
    targets: tuple[str, ...] = TARGETS  # module names (the last part of a linear layer's name)

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def peft_key(module: str, which: str) -> str:
    """PEFT's name of a layer's A or B: ("model.layers.0.self_attn.q_proj", "A") ->
    "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"."""
    assert which in ("A", "B"), which
    return f"{PREFIX}{module}.lora_{which}.weight"


def adapter_config(spec: LoRASpec, base: str) -> dict:
    """adapter_config.json as peft writes it for a plain LoRA of a causal LM (no dropout, no bias)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
            "r": spec.rank, "lora_alpha": spec.alpha, "target_modules": sorted(spec.targets),
            "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "inference_mode": True,
            "use_rslora": False, "use_dora": False, "modules_to_save": None, "init_lora_weights": True,
            "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {}}


def write_adapter(out_dir: str | Path, tensors: dict[str, torch.Tensor], spec: LoRASpec, base: str) -> None:
    """`tensors` (PEFT names) and the config into `out_dir`; the caller names the directory
    (a checkpoint writes under a temporary name and renames)."""
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(d / WEIGHTS))
    (d / CONFIG).write_text(json.dumps(adapter_config(spec, base), indent=2))


def read_adapter(adapter_dir: str | Path) -> tuple[LoRASpec, dict[str, torch.Tensor], str]:
    """A PEFT adapter directory -> (spec, tensors by PEFT name, its base). ValueError naming what is
    not a plain LoRA floe can train on."""
    d = Path(adapter_dir)
    try:
        cfg = json.loads((d / CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{d}: no readable {CONFIG} ({e})") from None
    if cfg.get("peft_type") != "LORA":
        raise ValueError(f"{d / CONFIG}: peft_type {cfg.get('peft_type')!r}, not LORA")
    for key in ("use_dora", "use_rslora", "fan_in_fan_out"):
        if cfg.get(key):
            raise ValueError(f"{d / CONFIG}: {key} is set; floe trains plain LoRA only")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern") or cfg.get("modules_to_save"):
        raise ValueError(f"{d / CONFIG}: per-layer ranks, alphas or modules_to_save are not supported")
    targets = cfg.get("target_modules")
    if isinstance(targets, str) or not targets:
        raise ValueError(f"{d / CONFIG}: target_modules must be a list of module names, not {targets!r}")
    spec = LoRASpec(int(cfg["r"]), float(cfg["lora_alpha"]), tuple(sorted(targets)))
    return spec, load_file(str(d / WEIGHTS)), str(cfg.get("base_model_name_or_path") or "")


def module_of(key: str) -> str:
    """The inverse of peft_key: a PEFT name -> the adapted layer's own name."""
    assert key.startswith(PREFIX) and key.endswith((".lora_A.weight", ".lora_B.weight")), key
    return key[len(PREFIX):-len(".lora_A.weight")]


@torch.no_grad()
def merged(base: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], spec: LoRASpec) -> dict[str, torch.Tensor]:
    """Full weights by HF name: W + (alpha / r) B A for each adapted layer (computed in fp32, then
    cast to W's dtype), every other tensor of `base` as it is. `base` is left untouched."""
    out = dict(base)
    for key in tensors:
        if key.endswith(".lora_A.weight"):
            module = module_of(key)
            a, b = tensors[key].float(), tensors[peft_key(module, "B")].float()
            w = base[f"{module}.weight"]
            out[f"{module}.weight"] = (w.float() + spec.scale * (b @ a)).to(w.dtype)
    return out
