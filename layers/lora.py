"""LoRA (--lora-rank r): adapters on the model's linear layers, and their files in PEFT's format.

W x + b + (alpha / r) B A x for each adapted linear layer: A (r, in) and B (out, r) are trained in
fp32, the base W (and b) stays frozen, as does every other weight (embedding, norms, LM head).
`add` turns each target nn.Linear into a `LoRALinear` that keeps the layer's own `weight` and
`bias` and gains `lora_A` and `lora_B`, so the model's state_dict names are HF's plus PEFT's
suffixes (`...q_proj.lora_A.weight`), and PEFT's file name of a tensor is `PREFIX` + that name.
An adapter on disk is PEFT's directory (adapter_config.json and adapter_model.safetensors with
PEFT's names), so peft, transformers and vLLM load it as it is.

Simplifications:
1. The adapter is plain LoRA: no dropout (RL's batches are fresh samples, and dropout would make
   the engine's policy differ from the trainer's), no bias, no DoRA or rsLoRA, one rank and
   alpha for every layer. PEFT's init: A Kaiming-uniform, B zero, so step 0 is the base model.
2. The base stays in fp32 by default, like full fine-tuning's weights. `--base-dtype bf16` stores the
   adapted layers' frozen weight and bias in bf16 (half their bytes on every rank; real checkpoints
   are bf16, so nothing is lost loading them) and upcasts them per call (`FrozenLinear`, which keeps
   the bf16 tensor for the backward, not the upcast copy); the adapters and their AdamW state stay
   fp32, and a merge is computed and returned in fp32. The embedding, norms and LM head stay fp32.
3. The built-in engine gets merged weights, W + (alpha / r) B A, computed in fp32 from the
   untouched base on every push (torch_engine.TorchEngine), so what samples is a plain model. vLLM
   serves the adapter itself, and only the adapter moves on a push (vllm_engine.VLLMEngine), or
   takes merged weights with --lora-merged.

    python train.py --lora-rank 8                       # the reverse-text job with rank-8 adapters (lr 3e-3)
    python -m pytest -q tests/test_lora.py              # against peft, transformers and autograd
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from safetensors.torch import save as st_save
from torch import nn

from config import LORA_TARGETS
from layers.parallel import full

TARGETS = LORA_TARGETS  # every linear of a block: the flag's default
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the max_lora_rank values vLLM 0.32 accepts
BASE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # --base-dtype
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


def spec_of(cfg) -> LoRASpec | None:
    """The config's adapters (targets in name order, as adapter_config.json lists them); None: full fine-tuning."""
    return LoRASpec(cfg.lora_rank, float(cfg.lora_alpha), tuple(sorted(cfg.lora_targets))) if cfg.lora_rank else None


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
    blob = st_save({k: v.detach().float().contiguous().cpu() for k, v in tensors.items()}, metadata={"format": "pt"})
    (d / WEIGHTS).write_bytes(blob)  # a full disk raises OSError here, as every other checkpoint write does
    (d / CONFIG).write_text(json.dumps(adapter_config(spec, base), indent=2))


def read_adapter(adapter_dir: str | Path) -> tuple[LoRASpec, dict[str, torch.Tensor], str]:
    """A PEFT adapter directory -> (spec, tensors by PEFT name, its base). ValueError naming what is
    not a plain LoRA floe can train on."""
    d = Path(adapter_dir)
    for name in (CONFIG, WEIGHTS):  # a FIFO would block the read forever
        if (d / name).exists() and not (d / name).is_file():
            raise ValueError(f"{d / name}: not a regular file")
    try:
        cfg = json.loads((d / CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{d}: no readable {CONFIG} ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{d / CONFIG}: not a JSON object (PEFT's adapter config)")
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
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if type(rank) is not int or rank < 1:
        raise ValueError(f"{d / CONFIG}: r must be the adapter's rank, an integer >= 1, got {json.dumps(rank)}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or alpha <= 0:
        raise ValueError(f"{d / CONFIG}: lora_alpha must be a number > 0, got {json.dumps(alpha)}")
    if not all(isinstance(t, str) for t in targets):
        raise ValueError(f"{d / CONFIG}: target_modules must be a list of module names, not {targets!r}")
    try:
        tensors = load_file(str(d / WEIGHTS))
    except Exception as e:  # missing, truncated or not safetensors: safetensors raises its own types
        raise ValueError(f"{d / WEIGHTS}: unreadable safetensors file ({' '.join(str(e).split())})") from None
    return LoRASpec(rank, float(alpha), tuple(sorted(targets))), tensors, str(cfg.get("base_model_name_or_path") or "")


def module_of(key: str) -> str:
    """The inverse of peft_key: a PEFT name -> the adapted layer's own name."""
    assert key.startswith(PREFIX) and key.endswith((".lora_A.weight", ".lora_B.weight")), key
    return key[len(PREFIX):-len(".lora_A.weight")]


@torch.no_grad()
def merge(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """One layer's W + (alpha / r) B A (one fused multiply-add, no (out, in) temporary but the result),
    in fp32 whatever W's dtype (a bf16 base's W + BA rounded to bf16 would lose the adapter's small
    updates): what the engines load and `merged` saves, bit for bit."""
    return torch.addmm(w.float(), b.float().to(w.device), a.float().to(w.device), alpha=scale)


@torch.no_grad()
def merged(base: dict[str, torch.Tensor], tensors: dict[str, torch.Tensor], spec: LoRASpec) -> dict[str, torch.Tensor]:
    """Full weights by HF name: W + (alpha / r) B A for each adapted layer (`merge`), every other
    tensor of `base` as it is. `base` is left untouched."""
    out = dict(base)
    for module in sorted({module_of(k) for k in tensors}):
        w = f"{module}.weight"
        out[w] = merge(base[w], tensors[peft_key(module, "A")], tensors[peft_key(module, "B")], spec.scale)
    return out


# ----------------------------------------------------------------------------- the adapters in the model

class FrozenLinear(torch.autograd.Function):
    """x W^T + b for a frozen W (and b) stored in a lower precision than x: upcast for this call only,
    and the backward saves W as stored (bf16: half the upcast copy's bytes) and returns x's gradient
    alone (W and b get none). Under autocast the matmul runs in the autocast dtype, as an fp32 W's would."""

    @staticmethod
    def forward(ctx, x, w, b):
        ctx.save_for_backward(w)
        ctx.dtype = x.dtype
        return F.linear(x, w.to(x.dtype), None if b is None else b.to(x.dtype))

    @staticmethod
    def backward(ctx, grad):
        (w,) = ctx.saved_tensors
        return (grad @ w.to(grad.dtype)).to(ctx.dtype), None, None


class LoRALinear(nn.Module):
    """An nn.Linear's frozen `weight` (out, in) and `bias`, under the same names, plus its adapter:
    y = x W^T + b + scale * B(A x), lora_A.weight (r, in), lora_B.weight (out, r), as PEFT computes it.
    `base_dtype` bf16 stores the frozen weight and bias in bf16 (`FrozenLinear` upcasts them per call)."""

    def __init__(self, linear: nn.Linear, rank: int, scale: float, base_dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.weight, self.bias, self.scale = linear.weight, linear.bias, scale
        if base_dtype != linear.weight.dtype:
            self.weight = nn.Parameter(linear.weight.detach().to(base_dtype), requires_grad=False)
            self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().to(base_dtype), requires_grad=False)
        out_features, in_features = linear.weight.shape
        dev = device or linear.weight.device  # a base on the meta device (the sharded load) gets real adapters
        self.lora_A = nn.Linear(in_features, rank, bias=False, device=dev, dtype=torch.float32)
        self.lora_B = nn.Linear(rank, out_features, bias=False, device=dev, dtype=torch.float32)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # PEFT's init_lora_weights=True
        nn.init.zeros_(self.lora_B.weight)
        self.off = False  # the adapter left out: the frozen base alone (`adapters_off`, --teacher base)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight.dtype == torch.float32:
            base = F.linear(x, self.weight, self.bias)
        else:
            base = FrozenLinear.apply(x, self.weight, self.bias)
        return base if self.off else base + self.lora_B(self.lora_A(x)) * self.scale


def linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The decoder blocks' linear layers by name (the embedding and the LM head are not among them)."""
    return {n: m for n, m in model.named_modules() if ".layers." in f".{n}" and isinstance(m, (nn.Linear, LoRALinear))}


def check_spec(shapes: dict[str, tuple[int, ...]], rank: int, targets) -> None:
    """ValueError, naming the flag, for a target that matches none of the linear layers (`shapes`: name ->
    weight shape) or a rank above the narrowest adapted layer's width: `add`'s check, and the memory plan's
    (run/start.py), which has the shapes but no model."""
    kinds = sorted({n.rsplit(".", 1)[-1] for n in shapes})
    if stray := [t for t in targets if t not in kinds]:
        raise ValueError(f"--lora-targets {stray[0]} matches no linear layer of the model (its layers: {', '.join(kinds)}; "
                         "the embedding and the LM head stay frozen)")
    chosen = {n: w for n, w in shapes.items() if n.rsplit(".", 1)[-1] in targets}
    name, shape = min(chosen.items(), key=lambda nw: min(nw[1]))  # the narrowest bounds the rank
    if rank > min(shape):  # B A would have rank <= width anyway: the extra rows train nothing new
        raise ValueError(f"--lora-rank {rank} is larger than {name}'s width {min(shape)} (weight "
                         f"{shape}), the narrowest adapted layer; use a rank <= {min(shape)}")


def add(model: nn.Module, spec: LoRASpec, base_dtype: str = "fp32", device=None) -> None:
    """Freeze every weight of a model.Transformer and give each target layer an adapter (fp32, whole, on
    `device` or the layer's, drawn from torch's global RNG), its frozen weight in `base_dtype` (--base-dtype);
    `model.lora` becomes `spec`. ValueError, naming the flag, for a target that matches no layer or a
    rank above a layer's width."""
    layers = linears(model)
    check_spec({n: tuple(m.weight.shape) for n, m in layers.items()}, spec.rank, spec.targets)
    chosen = {n: m for n, m in layers.items() if n.rsplit(".", 1)[-1] in spec.targets}
    model.requires_grad_(False)
    for name, m in chosen.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, LoRALinear(m, spec.rank, spec.scale, BASE_DTYPES[base_dtype], device))
    model.lora = spec


def adapted(model: nn.Module) -> dict[str, LoRALinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


@contextlib.contextmanager
def adapters_off(model: nn.Module):
    """The model as its frozen base, every adapter left out, for the duration (--teacher base: the base
    scores the student's samples with no second copy of the weights)."""
    layers = adapted(model).values()
    for m in layers:
        m.off = True
    try:
        yield model
    finally:
        for m in layers:
            m.off = False


def is_adapter_key(name: str) -> bool:
    """A state_dict name of an adapter tensor (`....lora_A.weight`, `....lora_B.weight`)."""
    return name.endswith((".lora_A.weight", ".lora_B.weight"))


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter's tensors by PEFT name, fp32, whole. Under FSDP2 a collective: every trainer rank
    calls it (in the same module order) and gets every tensor."""
    out = {}
    for name, m in adapted(model).items():
        out[peft_key(name, "A")] = full(m.lora_A.weight).detach().float()
        out[peft_key(name, "B")] = full(m.lora_B.weight).detach().float()
    return out


def base_state(model: nn.Module, only: set[str] | None = None) -> dict[str, torch.Tensor]:
    """The untouched base weights by HF name (what `merged` merges into), whole; `only`: these names
    alone. Under FSDP2 a collective, as `adapter_state`."""
    return {k: full(v).detach() for k, v in model.state_dict().items()
            if not is_adapter_key(k) and (only is None or k in only)}


@torch.no_grad()
def load_adapter(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """PEFT-named tensors (checked by `check_adapter`) into the model's adapters."""
    for name, m in adapted(model).items():
        m.lora_A.weight.copy_(tensors[peft_key(name, "A")])
        m.lora_B.weight.copy_(tensors[peft_key(name, "B")])


def check_adapter(model: nn.Module, tensors: dict[str, torch.Tensor], source: str) -> None:
    """The tensors are exactly the model's adapters (every layer, nothing more) in their shapes and
    finite: ValueError naming `source` and the first tensor that is not."""
    want = {peft_key(n, w): tuple(getattr(m, f"lora_{w}").weight.shape) for n, m in adapted(model).items() for w in "AB"}
    if missing := sorted(set(want) - set(tensors)):
        raise ValueError(f"{source}: no {missing[0]} (the adapter does not cover the model's {module_of(missing[0])})")
    if extra := sorted(set(tensors) - set(want)):
        raise ValueError(f"{source}: {extra[0]} names no adapted layer of the model")
    for k, shape in want.items():
        if tuple(tensors[k].shape) != shape:
            raise ValueError(f"{source}: {k} has shape {tuple(tensors[k].shape)}, the model's layer needs {shape}")
        if not tensors[k].is_floating_point():  # an int or bool tensor would be copied in as floats, silently
            raise ValueError(f"{source}: {k} is stored as {str(tensors[k].dtype).removeprefix('torch.')}, not as "
                             "a weight (a floating-point tensor)")
        if not torch.isfinite(tensors[k]).all():
            raise ValueError(f"{source}: {k} holds NaN or inf")


def strip(model: nn.Module) -> None:
    """Each LoRALinear back to a plain nn.Linear over the same weight and bias (the engine's copy,
    whose weights are merged on every push); `model.lora` becomes None."""
    for name, m in adapted(model).items():
        parent, _, child = name.rpartition(".")
        plain = nn.Linear(1, 1, bias=False, device="meta")
        plain.in_features, plain.out_features = m.weight.shape[1], m.weight.shape[0]
        plain.weight, plain.bias = m.weight, m.bias
        setattr(model.get_submodule(parent), child, plain)
    model.lora = None


def base_record(model: nn.Module, src: Path) -> dict:
    """A LoRA run's record of its base for config.json (`lora_base`: the directory, the sha256 of its
    weights and the model its config.json describes, `model.args`), which --resume reloads and checks;
    {} for full fine-tuning."""
    if model.lora is None:
        return {}
    return {"lora_base": {"path": str(Path(src).resolve()), "sha256": weights_sha256(src),
                          "config": dataclasses.asdict(model.args)}}


def weights_sha256(model_dir: str | Path) -> str:
    """sha256 over a HF directory's *.safetensors files (names and bytes, in name order): the run's
    record of its base, checked again on --resume."""
    h = hashlib.sha256()
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        if not f.is_file():  # a FIFO would block the read forever
            raise ValueError(f"{f}: not a regular file")
        h.update(f.name.encode() + b"\0")
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()
