"""What a lower-precision engine computes (--engine-dtype), as layers the built-in engine
(torch_engine.TorchEngine) swaps in for every nn.Linear, state_dict names unchanged.

1. `Rounded` (bf16, fp16): the input and output rounded to the dtype, the weight holding
   dtype values. On a CPU the arithmetic is fp32: most CPUs have no bf16 matmul units.
2. `Fp8Linear` (fp8): W8A8 as vLLM's fp8 path computes it, e4m3 weights with a scale per
   output channel and inputs quantized per token (`fp8_quantize`), bf16 outputs.
3. `LossScale`: the trainer's side of low precision, --train-dtype fp16's dynamic loss scale
   (train.optimizer_step applies it).

    python -m pytest -q tests/test_torch_engine.py    # against independent references
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32,
          "fp8": torch.bfloat16}  # fp8: e4m3 weights and activations into each matmul, bf16 everywhere else
FP8_MAX = 448.0  # the largest float8 e4m3 (fn) value


class Rounded(nn.Module):
    """An nn.Linear as a `dtype` engine computes it, emulated in fp32: the input and the output are
    rounded to `dtype`, and the weight already holds `dtype` values (TorchEngine.load_weights).

    A bf16 matmul multiplies bf16 inputs, accumulates in fp32 and stores bf16; products of two
    bf16 values are exact in fp32, so this is the same arithmetic up to the summation order. What
    it leaves in fp32 (norms, RoPE, attention, the residual stream) a bf16 engine would round too,
    so the mismatch is smaller (tests/test_torch_engine.py holds it below the native dtype's and within
    a factor of it), and on a CPU without bf16 units it takes a fraction of the native time
    (docs/experiments.md "2026-12-01: the CPU step, before and after four changes")."""

    def __init__(self, linear: nn.Linear, dtype: torch.dtype):
        super().__init__()
        self.weight, self.bias, self.dtype = linear.weight, linear.bias, dtype  # the same names

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.dtype).float(), self.weight, self.bias).to(self.dtype).float()


def fp8_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x ~ q * scale per row (the last dim): q holds float8 e4m3 values (returned in fp32, where
    they are exact), scale = max |row| / 448 in fp32, so each row's largest entry maps to 448.
    A weight [out, in] gets one scale per output channel; activations one per token."""
    x = x.float()
    scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float(), scale


class Fp8Linear(nn.Module):
    """An nn.Linear as a W8A8 fp8 engine computes it (vLLM's fp8 path; --engine-dtype fp8): the
    weight in e4m3 with a scale per output channel, requantized on every push (load_weights),
    and the input quantized per token with a dynamic scale right before the matmul. The e4m3
    values are exact in fp32 and bf16 and so are their products in fp32, so the matmul
    `xq @ wq.T` accumulates as an fp8 GEMM does; the two scales are applied after it, the bias
    in fp32, and the output is rounded to bf16. On a CPU it all runs in fp32 (`emulated`); on a
    GPU wq is stored in bf16 and the matmul runs in bf16 (its output rounded before the scales)."""

    def __init__(self, linear: nn.Linear, emulated: bool):
        super().__init__()
        self.weight, self.bias, self.emulated = linear.weight, linear.bias, emulated  # the same names
        self.register_buffer("scale", torch.ones(linear.out_features, device=linear.weight.device), persistent=False)

    @torch.no_grad()
    def quantize(self, weight: torch.Tensor) -> None:
        q, scale = fp8_quantize(weight)
        self.weight.copy_(q)
        self.scale.copy_(scale[:, 0])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xq, sx = fp8_quantize(x.to(torch.bfloat16))  # what a bf16 engine would hand the fp8 GEMM
        y = F.linear(xq.to(self.weight.dtype), self.weight).float() * sx * self.scale
        if self.bias is not None:
            y = y + self.bias.float()
        y = y.to(torch.bfloat16)
        return y.float() if self.emulated else y


def emulate(model: nn.Module, dtype: str, emulated: bool) -> None:
    """Swap every nn.Linear of `model` for a `Rounded` one, or with fp8 for an `Fp8Linear`
    (state_dict names unchanged). An fp8 engine's head is its own quantized copy (TorchEngine)."""
    for module in list(model.modules()):
        for child, sub in list(module.named_children()):
            if type(sub) is nn.Linear:
                setattr(module, child, Fp8Linear(sub, emulated) if dtype == "fp8" else Rounded(sub, DTYPES[dtype]))


@dataclass
class LossScale:
    """--train-dtype fp16's dynamic loss scaling (PyTorch GradScaler's defaults): the loss is
    multiplied by `value` before the backward, so small gradients do not flush to zero in fp16,
    and the gradients are divided by it before clipping. A non-finite gradient halves it and
    skips the step; `growth` finite steps in a row double it. bf16 and fp32 keep 1.0."""

    value: float = 1.0
    dynamic: bool = False
    good: int = 0  # finite steps since the last change
    growth: int = 2000

    @classmethod
    def for_dtype(cls, train_dtype: str) -> LossScale:
        return cls(2.0**16, dynamic=True) if train_dtype == "fp16" else cls()

    def update(self, finite: bool) -> None:
        if not self.dynamic:
            return
        self.good = self.good + 1 if finite else 0
        if not finite:
            self.value /= 2
        elif self.good == self.growth:
            self.value, self.good = self.value * 2, 0
