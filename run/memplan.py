"""The memory plan: what each process of a run will hold, from config.json alone, before any weight loads.

A run that does not fit should say so before minutes of loading, and a user sizing an 8-GPU job
should be able to do it from a laptop. `plan(shape, setup)` counts, for each role of a run,
bytes by component:
- trainer rank: its FSDP2 shard of the weights (LoRA: the frozen base in --base-dtype, the
  adapters in fp32), --teacher's fp32 shard (and its root under FSDP2), gradients and AdamW state of what it trains (fp32, 4 and 8 bytes a parameter,
  divided by the trainer ranks), what FSDP2 holds gathered during a step, the colocated engine's
  copy, the activations of one --micro-batch-tokens micro-batch, the LM head's chunk, and the
  process's baseline (the interpreter and torch: a measured empty start on a CPU);
- inference rank (--inference-gpus): one engine copy (built-in: its dtype; vLLM: its share) and one
  pushed tensor (a LoRA merge also keeps the fp32 base);
- host per node: on a CPU, every process's total; on CUDA, what each process stages while loading
  and what rank 0 holds during a save.
`startup` is each role's peak while it loads, with the sharded load: its shard, the engine, one
tensor or one block read whole in fp32 (whichever is larger), and the baseline.

Where the figures come from:
1. Parameters are counted from the shapes that model.ModelArgs reads from config.json, exactly
   as model.Transformer builds them (tests/test_memplan.py counts both, and transformers').
2. Activations are bytes a token a decoder layer. The shape's part is counted: `saved_elements`
   lists what autograd keeps for a block's backward (tests/test_memplan.py checks the list
   against saved_tensors_hooks on the real model). The CPU's figure (row attention, fp32) is that
   count times `CPU_FP32_CALIBRATION`, the peak RSS that `python bench/memory.py activations`
   measures over the count (the allocator's slack and the backward's own temporaries). Every
   other path (bf16/fp16 autocast, CUDA's flex attention) is the count alone: "computed", until
   bench/gpu.sh measures it.
3. With --activation-checkpointing blocks a layer keeps only its input (fp32, the residual
   stream) and one block's activations are alive at a time, recomputed in its backward. On the
   CPU that is all the measurement finds (the backward's temporaries fit in what the block's
   saved activations free; on CUDA they are added, computed).

Simplifications:
1. A document attends to its own keys: a group's shared prompt adds its keys to each completion's
   row on the CPU; the plan does not count them.
2. The engine's KV cache and the rollout's tensors are not planned: they are the engine's, sized
   by --prompts-per-step and --max-new-tokens, and freed before the trainer's step.
3. FSDP2 pads each shard to a multiple of the ranks: a few elements, not counted.

    python -m pytest -q tests/test_memplan.py
    python bench/memory.py activations          # the measured figures below
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from model import ModelArgs
from layers.lora import TARGETS

GIB = 2**30
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1}
CHECKPOINTING = ("auto", "off", "blocks")
# total memory of one GPU as nvidia-smi reports it, for --plan-check and docs/scale.md
DEVICES = {"H100-80GB": 81559 * 2**20, "H200": 143771 * 2**20}

# Measured by `python bench/memory.py activations` (2026-12-02, docs/experiments.md "the memory plan's
# CPU figures"): peak RSS a token a layer over `saved_elements` x 4 bytes, packed 64-token documents.
CPU_FP32_CALIBRATION = 1.113
# Measured by the same run: the backward's gradient temporaries, a token, in layers' activations (the
# slope in tokens that does not grow with the layers). CUDA reuses it, computed.
BACKWARD_LAYERS = 0.474
# Measured by `python bench/memory.py baseline` (the same entry): peak RSS of a process that imported
# train.py's modules and loaded nothing.
CPU_BASELINE = 289189888
# Measured by `python bench/memory.py activations` (the same entry): the CPU head's peak, in
# [chunk, V] fp32 tiles (kernels.head: the forward's tiles, then the backward's recomputed ones and their gradient).
CPU_HEAD_TILES = 6.19
# Not measured: the CUDA context and the caching allocator's slack beside torch's allocations.
CUDA_BASELINE = GIB
# The error the plan is held to (bench/memory.py sets each per-rank total beside its measured peak): a
# CUDA start stops only when the plan exceeds the device by more than this.
PLAN_ERROR = 0.15
CPU_TILE_ELEMENTS = 1 << 25  # kernels.TILE_ELEMENTS: the CPU head's [chunk, V] tile
CUDA_TILE_ELEMENTS = 1 << 27  # headkernels.GPU_TILES.chunk_elements: the dense backward's dlogits tile


class PlanError(ValueError):
    """A setup the plan cannot describe; the message is one line naming the flag."""


@dataclass(frozen=True)
class Shape:
    """A model's sizes, as model.ModelArgs reads them from config.json."""

    args: ModelArgs

    @staticmethod
    def from_config(cfg: dict, source: str = "config.json") -> Shape:
        return Shape(ModelArgs.from_hf(cfg, source))

    @staticmethod
    def from_dir(model_dir: str | Path) -> Shape:
        """config.json of a HF directory; no weight is read."""
        f = Path(model_dir) / "config.json"
        if f.exists() and not f.is_file():  # a FIFO would block the read forever
            raise PlanError(f"{f}: not a regular file")
        try:
            cfg = json.loads(f.read_text())
        except (OSError, ValueError) as e:
            raise PlanError(f"{f}: no readable config.json ({e})") from None
        return Shape.from_config(cfg, str(f))

    def linears(self) -> dict[str, tuple[int, int]]:
        """A block's linear layers by name: (in, out) features."""
        a = self.args
        q, kv, h, i = a.num_attention_heads * a.head_dim, a.num_key_value_heads * a.head_dim, a.hidden_size, a.intermediate_size
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def block_params(self) -> int:
        a, lin = self.args, self.linears()
        n = sum(i * o for i, o in lin.values()) + 2 * a.hidden_size + 2 * a.head_dim * a.qk_norm
        n += a.attention_bias * sum(lin[k][1] for k in ("q_proj", "k_proj", "v_proj")) + a.o_bias * a.hidden_size
        return n + a.mlp_bias * (2 * a.intermediate_size + a.hidden_size)

    def root_params(self) -> int:
        """The embedding, the untied head and the final norm: what FSDP2's root holds."""
        a = self.args
        return a.vocab_size * a.hidden_size * (1 + (not a.tie_word_embeddings)) + a.hidden_size

    def params(self) -> int:
        return self.root_params() + self.args.num_hidden_layers * self.block_params()

    def largest_tensor(self) -> int:
        return max(self.args.vocab_size * self.args.hidden_size, *(i * o for i, o in self.linears().values()))

    def adapter_params(self, rank: int, targets: tuple[str, ...]) -> int:
        """LoRA's A (r, in) and B (out, r) on each target layer of every block."""
        return self.args.num_hidden_layers * sum(rank * (i + o) for k, (i, o) in self.linears().items() if k in targets)


def saved_elements(shape: Shape, half: bool, document: int) -> tuple[int, int]:
    """What a decoder block keeps for its backward, a token: (fp32 elements, half-precision elements).

    fp32 (`half` False): each RMSNorm keeps its input, 1/rms and the normalized input, and the
    linears after it keep the norm's output (3H + 1, twice); q and k norms keep their input and
    normalized input and 1/rms per head; the CPU's row attention keeps its gathered q, k, v, its
    output, the log-sum-exp per head and its mask (`document` keys a query); o_proj keeps its
    input; the MLP keeps gate, silu(gate), up and their product (4I).
    Under bf16/fp16 autocast the linears keep bf16 casts of their inputs and the attention runs in
    bf16, while the norms' statistics stay fp32 (counted under CPU autocast; CUDA's flex attention
    keeps no mask: `document` 0)."""
    a = shape.args
    h, i, nh, nkv = a.hidden_size, a.intermediate_size, a.num_attention_heads, a.num_key_value_heads
    q, kv = nh * a.head_dim, nkv * a.head_dim
    if not half:
        return 6 * h + 2 + 5 * q + 4 * kv + 2 * nh + nkv + 4 * i + document, 0
    return 4 * h + 2 + q + 2 * nh + kv + nkv, 5 * h + 4 * q + 3 * kv + 4 * i + document


@dataclass(frozen=True)
class Setup:
    """The flags the plan reads (each field's flag in its comment)."""

    world: int = 1  # --plan-world, or torchrun's trainer ranks
    lora_rank: int = 0  # --lora-rank; 0: full fine-tuning
    lora_targets: tuple[str, ...] = TARGETS  # --lora-targets
    base_dtype: str = "fp32"  # --base-dtype: LoRA's frozen base
    train_dtype: str = "fp32"  # --train-dtype: fp32, or bf16/fp16 autocast
    engine: str = "torch"  # --engine: torch (built-in) or vllm
    engine_dtype: str = "bf16"  # --engine-dtype
    vllm_memory: float = 0.2  # --vllm-memory: vLLM's share of its device
    device: str = "cpu"  # --device
    device_bytes: int = 0  # one device's memory (vLLM's share is of it); 0: unknown
    inference_gpus: int = 0  # --inference-gpus
    micro_batch_tokens: int = 1024  # --micro-batch-tokens
    activation_checkpointing: str = "off"  # --activation-checkpointing: auto, off or blocks
    document_tokens: int = 0  # the longest document (the CPU's attention mask grows with it); 0: a whole micro-batch
    ranks_per_node: int = 0  # processes on one node; 0: every rank on one
    lora_merged: bool = False  # --lora-merged: vLLM takes merged weights (the built-in engine always does)
    teacher: Shape | None = None  # --teacher's config.json: its frozen fp32 weights, sharded like the trainer's

    def __post_init__(self):
        checks = [(self.world >= 1, f"--plan-world must be >= 1 trainer rank, got {self.world}"),
                  (self.lora_rank >= 0, f"--lora-rank must be >= 0, got {self.lora_rank}"),
                  (self.base_dtype in ("fp32", "bf16"), f"--base-dtype must be fp32 or bf16, got {self.base_dtype!r}"),
                  (self.base_dtype == "fp32" or self.lora_rank > 0, "--base-dtype bf16 is for LoRA's frozen base: add "
                   "--lora-rank r (full fine-tuning keeps fp32 master weights)"),
                  (self.train_dtype in ("fp32", "bf16", "fp16"), f"--train-dtype must be fp32, bf16 or fp16, got {self.train_dtype!r}"),
                  (self.engine in ("torch", "vllm"), f"--engine must be torch or vllm, got {self.engine!r}"),
                  (self.engine_dtype in DTYPE_BYTES, f"--engine-dtype must be one of {', '.join(DTYPE_BYTES)}, got {self.engine_dtype!r}"),
                  (self.device in ("cpu", "cuda"), f"--device must be cpu or cuda, got {self.device!r}"),
                  (self.inference_gpus >= 0, f"--inference-gpus must be >= 0, got {self.inference_gpus}"),
                  (self.micro_batch_tokens >= 1, f"--micro-batch-tokens must be >= 1, got {self.micro_batch_tokens}"),
                  (self.activation_checkpointing in CHECKPOINTING, f"--activation-checkpointing "
                   f"{self.activation_checkpointing!r} is not one of {', '.join(CHECKPOINTING)}")]
        if bad := next((why for ok, why in checks if not ok), None):
            raise PlanError(bad)


@dataclass
class Role:
    """One process's bytes by component at the step's peak, and at its start-up peak."""

    name: str
    parts: dict[str, int]
    startup: int
    computed: set[str] = field(default_factory=set)  # components not (yet) measured on this path

    @property
    def total(self) -> int:
        return sum(self.parts.values())


@dataclass
class Plan:
    shape: Shape
    setup: Setup  # activation_checkpointing resolved: off or blocks
    roles: list[Role]  # the trainer rank, the inference rank (with --inference-gpus), the host per node
    activations: dict[str, int]  # a trainer rank's activations with checkpointing off and with blocks

    def role(self, name: str) -> Role | None:
        return next((r for r in self.roles if r.name == name), None)


def trained(shape: Shape, s: Setup) -> int:
    return shape.adapter_params(s.lora_rank, s.lora_targets) if s.lora_rank else shape.params()


def low_params(shape: Shape, s: Setup) -> int:
    """A LoRA base's weights held in --base-dtype: the adapted layers' (lora.LoRALinear; their biases,
    a few elements, are counted fp32); the embedding, norms and head stay fp32."""
    if not s.lora_rank or s.base_dtype == "fp32":
        return 0
    return shape.args.num_hidden_layers * sum(i * o for k, (i, o) in shape.linears().items() if k in s.lora_targets)


def weight_bytes(shape: Shape, s: Setup) -> int:
    """The trainer's whole weights: fp32, or LoRA's base (the adapted layers in --base-dtype) plus fp32 adapters."""
    if not s.lora_rank:
        return 4 * shape.params()
    low = low_params(shape, s)
    return DTYPE_BYTES[s.base_dtype] * low + 4 * (shape.params() - low) + 4 * trained(shape, s)


def engine_bytes(shape: Shape, s: Setup) -> int:
    """One engine's copy. On a CPU the built-in engine emulates bf16/fp16/fp8 in fp32 storage; on CUDA
    fp8 keeps its e4m3 values in bf16 and adds the head's own copy (precision.Fp8Linear)."""
    if s.engine == "vllm":
        share = int(s.vllm_memory * s.device_bytes)
        return share or 2 * shape.params()  # without the device's size: its weights in bf16 at least
    if s.device == "cpu":
        return 4 * shape.params()
    if s.engine_dtype == "fp8":
        return 2 * shape.params() + 2 * shape.args.vocab_size * shape.args.hidden_size
    return DTYPE_BYTES[s.engine_dtype] * shape.params()


def token_bytes(shape: Shape, s: Setup) -> tuple[int, int, bool]:
    """(bytes a token a layer, bytes a token the backward adds, measured?) of the trainer's forward and backward."""
    half = s.train_dtype != "fp32"
    doc = (s.document_tokens or s.micro_batch_tokens) if s.device == "cpu" else 0
    full, low = saved_elements(shape, half, doc)
    per_layer = 4 * full + 2 * low
    measured = s.device == "cpu" and not half
    if measured:
        per_layer = int(per_layer * CPU_FP32_CALIBRATION)
    return per_layer, int(BACKWARD_LAYERS * per_layer), measured


def activation_bytes(shape: Shape, s: Setup) -> dict[str, int]:
    """One micro-batch's activations, checkpointing off and blocks. Under autocast each block also
    keeps bf16 casts of its linear weights until its backward: every block's without
    checkpointing, one block's with it (a bf16 LoRA base needs no cast)."""
    t, layers = s.micro_batch_tokens, shape.args.num_hidden_layers
    per_layer, outside, measured = token_bytes(shape, s)
    casts = 0
    if s.train_dtype != "fp32" and not (s.lora_rank and s.base_dtype == "bf16"):
        casts = 2 * sum(i * o for i, o in shape.linears().values())
    recomputed = per_layer + (0 if measured else outside)  # the docstring's "Where the figures come from", 3
    return {"off": t * (layers * per_layer + outside) + layers * casts,
            "blocks": t * (layers * 4 * shape.args.hidden_size + recomputed) + casts}


def head_bytes(shape: Shape, s: Setup) -> int:
    """The LM head's tiles: the CPU reference's [chunk, V] fp32 tiles (kernels.head), or the Triton
    dense backward's dlogits tile in the head's dtype plus its fp32 d_hidden (triton_head)."""
    v, t = shape.args.vocab_size, s.micro_batch_tokens
    if s.device == "cpu":
        return int(CPU_HEAD_TILES * min(t, max(1, CPU_TILE_ELEMENTS // v)) * v * 4)
    width = 4 if s.train_dtype == "fp32" else 2
    return min(t * v, CUDA_TILE_ELEMENTS) * width + 4 * t * shape.args.hidden_size


def gathered_bytes(shape: Shape, s: Setup) -> int:
    """FSDP2 during a step (2 ranks or more): the root stays gathered from forward to backward, two
    blocks are gathered at once (the current one and the prefetched next), and one block's gradients
    are whole until their reduce-scatter."""
    if s.world == 1:
        return 0
    low = low_params(shape, s) // shape.args.num_hidden_layers  # a block's weights in --base-dtype
    grads = 4 * (trained(shape, s) // shape.args.num_hidden_layers if s.lora_rank else shape.block_params())
    block = DTYPE_BYTES[s.base_dtype] * low + 4 * (shape.block_params() - low)
    return 4 * shape.root_params() + 2 * block + grads


def resolve(shape: Shape, s: Setup) -> Setup:
    """--activation-checkpointing auto: off on a CPU (the default job must not change); on CUDA blocks
    when the plan without it passes 80% of the device (or the device is unknown and it is large)."""
    if s.activation_checkpointing != "auto":
        return s
    off = dataclasses.replace(s, activation_checkpointing="off")
    if s.device == "cpu":
        return off
    need = trainer_role(shape, off).total
    return off if s.device_bytes and need <= 0.8 * s.device_bytes else dataclasses.replace(s, activation_checkpointing="blocks")


def trainer_role(shape: Shape, s: Setup) -> Role:
    w, n = s.world, trained(shape, s)
    baseline = CPU_BASELINE if s.device == "cpu" else CUDA_BASELINE
    engine = 0 if s.inference_gpus else engine_bytes(shape, s)
    parts = {"weights": weight_bytes(shape, s) // w, "gradients": 4 * n // w, "AdamW state": 8 * n // w,
             "FSDP2 gathered": gathered_bytes(shape, s), "engine copy": engine,
             "activations": activation_bytes(shape, s)[s.activation_checkpointing], "LM head chunk": head_bytes(shape, s),
             "baseline": baseline}
    if s.teacher is not None:  # its shard, and under FSDP2 its root, left gathered after its no-grad forward
        parts["teacher"] = 4 * s.teacher.params() // w + (4 * s.teacher.root_params() if w > 1 else 0)
    computed = {"activations"} - ({"activations"} if token_bytes(shape, s)[2] else set())
    computed |= {"baseline"} if s.device == "cuda" else set()
    startup = parts["weights"] + engine + 4 * max(shape.largest_tensor(), shape.block_params()) + baseline
    startup += 4 * s.teacher.params() // w if s.teacher is not None else 0
    return Role("trainer rank", parts, startup, computed)


def inference_role(shape: Shape, s: Setup) -> Role:
    """An --inference-gpus rank: its engine's copy and one pushed tensor in the wire's dtype (received,
    then cast into the copy: run/remote.py), or under LoRA the adapter's fp32 tensors; an engine that merges
    LoRA (the built-in one, vLLM with --lora-merged) also keeps the untouched fp32 base the merge reads."""
    baseline = CPU_BASELINE if s.device == "cpu" else CUDA_BASELINE
    parts = {"engine copy": engine_bytes(shape, s)}
    if s.lora_rank:
        parts["adapters"] = parts["push buffer"] = 4 * trained(shape, s)  # fp32: kept, and a push's received
        if s.engine == "torch" or s.lora_merged:
            parts["LoRA base"] = 4 * shape.params()
    else:
        wire = 4 if s.engine_dtype == "fp8" else DTYPE_BYTES[s.engine_dtype]
        parts["push buffer"] = wire * shape.largest_tensor()
    parts["baseline"] = baseline
    startup = sum(v for k, v in parts.items() if k != "push buffer") + 4 * max(shape.largest_tensor(), shape.block_params())
    return Role("inference rank", parts, startup, {"baseline"} if s.device == "cuda" else set())


def host_role(shape: Shape, s: Setup, trainer: Role, inference: Role | None) -> Role:
    """A node's RAM. On a CPU the processes are the devices. On CUDA each process holds the baseline
    and stages one tensor or block in fp32 while loading; rank 0 copies one gathered tensor at a time
    to the host during a save and writes it from there (run/shardfiles.py: no serialized copy)."""
    ranks = s.ranks_per_node or s.world + s.inference_gpus
    trainers = min(ranks, s.world)
    if s.device == "cpu":
        step = trainers * trainer.total + (ranks - trainers) * (inference.total if inference else 0)
        start = trainers * trainer.startup + (ranks - trainers) * (inference.startup if inference else 0)
        return Role("host per node", {"processes": step}, start)
    staging = 4 * max(shape.largest_tensor(), shape.block_params())
    parts = {"baseline": ranks * CPU_BASELINE, "save buffer": 4 * shape.largest_tensor()}
    return Role("host per node", parts, ranks * (CPU_BASELINE + staging))


def save_bytes(shape: Shape, s: Setup) -> int:
    """What a save adds on each trainer rank's device, beyond its shard and AdamW state: under FSDP2 each
    weight is gathered whole in turn, the all-gather's output and the whole tensor made of it (measured:
    twice the largest tensor, docs/experiments.md "2026-12-02: saves and resumes that scale"); one process
    writes its tensors from their own memory. Below the step's peak (the activations are gone by then)."""
    return 0 if s.world == 1 else 2 * 4 * shape.largest_tensor()


def plan(shape: Shape, setup: Setup) -> Plan:
    s = resolve(shape, setup)
    trainer = trainer_role(shape, s)
    inference = inference_role(shape, s) if s.inference_gpus else None
    roles = [trainer] + ([inference] if inference else []) + [host_role(shape, s, trainer, inference)]
    return Plan(shape, s, roles, activation_bytes(shape, s))
