"""The memory plan's measured figures, and the start-up it plans against, on the CPU.

Each figure is one fresh process's peak RSS (`resource.getrusage` ru_maxrss, read in-process at the
named point), one process at a time, so no figure holds another's memory. Studies:
- `baseline`: a process that imported train.py's modules and loaded nothing (memplan.CPU_BASELINE).
- `activations`: one forward and backward of the packed training forward (row attention, fp32)
  at Qwen3-0.6B's widths with 2 and 4 layers (a small vocabulary: the layers are measured), at
  1k, 2k and 4k tokens of packed 64-token documents; the slope in tokens at each depth gives
  bytes a token, their difference bytes a token a layer, which over memplan.saved_elements is
  memplan.CPU_FP32_CALIBRATION. The same with one long document per micro-batch (the CPU's mask
  grows with the document) and with each block recomputed in the backward
  (--activation-checkpointing blocks: model.Transformer.checkpointing), each beside the plan's figure;
  and the LM head's peak in [chunk, V] tiles (memplan.CPU_HEAD_TILES).
- `recompute`: the time of one forward and backward at the same 4-layer shape and tokens (packed
  64-token documents), checkpointing off, blocks, and blocks with glibc's allocator left as it was,
  each in its own process (blocks sets the allocator as start.build does), in rotating rounds: the
  step-time cost of recomputing each block, as the ratio of medians.
- `scale`: docs/scale.md's table of the plan for Qwen3-1.7B to 32B on 8 GPUs (computed only).
- `cuda` (bench/gpu.sh runs it): one step's torch.cuda.max_memory_allocated at the 0.6B shape, 4k
  and 16k tokens, checkpointing off and blocks, beside the plan.
- `startup`: train.py on a random Qwen3-0.6B-shaped checkpoint the bench writes in bf16 as HF
  sharded files (model.safetensors.index.json), one process and `torchrun --nproc_per_node 2`
  (gloo; the sharded load), full fine-tuning and --lora-rank 16, the built-in engine: each rank's
  peak RSS right after start.build returns, before step 1, beside the plan's start-up peak and
  the arithmetic of what the load before the sharded one held (every rank the whole model and an
  fp32 deep copy for its engine).
- `save`: on the same checkpoint, the trainer's model (one process: whole; two gloo ranks: the
  sharded load) with AdamW state of its shape: each rank's RSS before checkpoint.save_checkpoint
  and its peak during it (VmHWM, reset just before the save), then a fresh process per rank reading
  the checkpoint back as a resume does (`whole`, load_training_state; no engine) and its peak RSS;
  beside the arithmetic of what the save and resume before the streamed, per-rank files held.
- `inference`: train.py with --inference-gpus 1 under `torchrun --nproc_per_node 3` (2 trainer ranks,
  1 inference rank; gloo) for 2 steps with no checkpoint, full fine-tuning, the built-in engine: the
  inference rank's peak RSS once its engine is built and at the run's end (its pushes and calls
  done), beside the plan's inference rank and the arithmetic of the copies before the streamed push
  (floe's own copy in the wire's dtype beside the engine's).
- `steady`: train.py for 3 steps with no checkpoint, one process and 2 ranks, full fine-tuning and
  --lora-rank 16 with --base-dtype fp32 and bf16: each rank's peak RSS after step 3's optimizer
  step beside the plan's per-rank total.

Simplifications:
1. Memory only, except `recompute`, which is timed (run it alone on the machine).
2. A peak RSS includes what glibc's heap keeps after a free (buffers under its mmap threshold,
   which rises up to 32 MiB); the plan counts live bytes. `MALLOC_MMAP_THRESHOLD_=131072` before a
   command makes the children's RSS track the live set (docs/scale.md).

    python bench/memory.py baseline
    python bench/memory.py activations     # 13 processes, ~15 min on 2 cores, the largest ~3 GiB
    python bench/memory.py startup         # 4 runs (2 with 2 ranks), the largest ~9 GiB in all; writes runs/memory/
    python bench/memory.py startup --shape 1.7b --runs 2x16    # LoRA r16 on Qwen3-1.7B, 2 ranks: ~21 GiB in all
    python bench/memory.py save            # 2 saves and 2 resumes (one with 2 ranks); writes runs/memory/
    python bench/memory.py steady          # 6 runs of 3 steps (3 with 2 ranks), the largest ~17 GiB in all
    python bench/memory.py steady --runs 2x16 --base-dtype bf16           # one run: RANKSxLORA_RANK
    python bench/memory.py _fb 4 1024 64 1  # one forward and backward: layers, tokens, document length, blocks (1)
    python bench/memory.py inference       # 3 ranks (1 samples) of 2 steps, ~7 GiB in all
    python bench/memory.py recompute       # off against blocks, timed: ~20 min on 2 quiet cores
    python bench/memory.py scale           # docs/scale.md's table: computed, nothing is measured
    python bench/memory.py cuda            # on a GPU: the plan against max_memory_allocated
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from model import ModelArgs, Transformer, init_weights  # noqa: E402
from run.memplan import (BACKWARD_LAYERS, CPU_FP32_CALIBRATION, DEVICES, Setup, Shape, TARGETS, activation_bytes,
    plan, save_bytes, saved_elements)  # noqa: E402
from run.planreport import fits  # noqa: E402

QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=512)
TOKENS, DOCUMENT, SMALL_VOCAB = (1024, 2048, 4096), 64, 4096
GIB = 2**30


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


_done: dict[tuple, dict] = {}


def child(args: list[str]) -> dict:
    """`python bench/memory.py _NAME ARGS` in a fresh process: its last stdout line, parsed (a figure
    asked twice is measured once)."""
    if tuple(args) in _done:
        return _done[tuple(args)]
    r = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, cwd=ROOT)
    if r.returncode:
        raise SystemExit(f"{' '.join(args)}: exit {r.returncode}\n{r.stderr[-3000:]}")
    _done[tuple(args)] = json.loads(r.stdout.strip().splitlines()[-1])
    return _done[tuple(args)]


def ranks_child(args: list[str], ranks: int) -> list[dict]:
    """The same under `torchrun --nproc_per_node ranks` (gloo): each rank's line, in the order they came."""
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master-addr",
                        "127.0.0.1", "--master-port", "29533", __file__, *args], capture_output=True, text=True, cwd=ROOT)
    if r.returncode:
        raise SystemExit(f"{' '.join(args)} x {ranks} ranks: exit {r.returncode}\n{r.stderr[-3000:]}")
    return [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]


# ----------------------------------------------------------------------------- activations

def layer_shape(layers: int) -> dict:
    return {**QWEN3_06B, "vocab_size": SMALL_VOCAB, "num_hidden_layers": layers}


def packed_model(layers: int, tokens: int, document: int, blocks: bool, mapped: bool):
    """The model at `layers` layers and one micro-batch of `tokens` in `document`-token documents;
    `mapped`: the allocator set as start.build sets it for blocks on a CPU."""
    torch.manual_seed(0)
    model = Transformer(ModelArgs(**layer_shape(layers)))
    init_weights(model)
    model.checkpointing = blocks  # --activation-checkpointing blocks
    if mapped:
        from run import start
        start.map_large_buffers()
    ids = torch.randint(0, SMALL_VOCAB, (tokens,))
    return model, (ids, torch.arange(tokens) % document, torch.arange(tokens) // document)


def forward_backward(layers: int, tokens: int, document: int, blocks: bool) -> dict:
    """One forward and backward; the peak and the RSS just before the forward."""
    model, batch = packed_model(layers, tokens, document, blocks, mapped=blocks)
    before, peak_before = rss(), peak_rss()
    model(*batch).sum().backward()
    return {"peak": peak_rss(), "before": before, "peak_before": peak_before}


def head_tiles(tokens: int) -> dict:
    """The CPU head's peak over its [chunk, V] fp32 tile, at Qwen3-0.6B's vocabulary."""
    from kernels import TILE_ELEMENTS, head
    v, h = QWEN3_06B["vocab_size"], QWEN3_06B["hidden_size"]
    weight = torch.randn(v, h) * 0.02
    hidden = torch.randn(tokens, h, requires_grad=True)
    labels = torch.randint(0, v, (tokens,))
    before = rss()
    head(hidden, weight, labels, impl="torch")[0].sum().backward()
    chunk = max(1, min(tokens, TILE_ELEMENTS // v))
    extra = peak_rss() - before - hidden.grad.nbytes  # the hidden's gradient is the head's output, not a tile
    return {"peak": peak_rss(), "before": before, "tiles": extra / (chunk * v * 4), "chunk": chunk}


def slope(points: list[tuple[int, int]]) -> float:
    """The least-squares slope of bytes over tokens."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    return sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)


def activations(a) -> str:
    shape = Shape(ModelArgs(**layer_shape(2)))
    counted = 4 * saved_elements(shape, False, DOCUMENT)[0]
    runs = {(layers, t): child(["_fb", str(layers), str(t), str(DOCUMENT), "0"]) for layers in (2, 4) for t in TOKENS}
    per = {layers: slope([(t, runs[layers, t]["peak"]) for t in TOKENS]) for layers in (2, 4)}
    per_layer, outside = (per[4] - per[2]) / 2, per[2] - 2 * (per[4] - per[2]) / 2
    lines = [f"Qwen3-0.6B widths (hidden 1024, intermediate 3072, 16/8 heads of 128), vocab {SMALL_VOCAB}, fp32, "
             f"row attention, torch {torch.__version__}, {torch.get_num_threads()} threads", "",
             "| layers | tokens | documents | peak RSS | RSS before the forward | peak - before |", "|" + " --- |" * 6]
    for (layers, t), r in runs.items():
        lines.append(f"| {layers} | {t} | {t // DOCUMENT} x {DOCUMENT} | {r['peak'] / GIB:.3f} GiB | "
                     f"{r['before'] / GIB:.3f} GiB | {(r['peak'] - r['before']) / GIB:.3f} GiB |")
    lines += ["", f"bytes a token a layer: {per_layer:.0f} measured, {counted} counted (memplan.saved_elements x 4): "
              f"this run's CPU_FP32_CALIBRATION = {per_layer / counted:.3f} (memplan: {CPU_FP32_CALIBRATION}); bytes a "
              f"token outside the layers (the backward's temporaries): {outside:.0f}, this run's BACKWARD_LAYERS = "
              f"{outside / per_layer:.3f} (memplan: {BACKWARD_LAYERS}). The fit moves between runs with what glibc's "
              "heap keeps; the table below holds memplan's figures, the plan's, against this run's peaks.", ""]
    lines += against_plan()
    h = child(["_head", "4096"])
    lines += ["", f"LM head at vocab {QWEN3_06B['vocab_size']}, 4096 tokens, {h['chunk']}-token chunks: peak - before "
              f"- d_hidden = {h['tiles']:.2f} [chunk, V] fp32 tiles: CPU_HEAD_TILES = {h['tiles']:.2f}"]
    return "\n".join(lines)


def against_plan() -> list[str]:
    """Four layers: packed and long documents, and checkpointed blocks, measured (peak - RSS before
    - the weight gradients) against the plan's activations as memplan has them; and the process's
    total (the RSS before the forward, the gradients, the activations) with the plan's activations in
    place of the measured ones."""
    sh4 = Shape(ModelArgs(**layer_shape(4)))
    lines = ["| 4 layers, tokens | documents | checkpointing | peak - before - gradients | plan's activations | "
             "plan / measured | the process's total: plan / measured |", "|" + " --- |" * 7]
    for t in TOKENS:
        for doc, blocks in ((DOCUMENT, False), (t, False), (DOCUMENT, True)):
            r = child(["_fb", "4", str(t), str(doc), str(int(blocks))])
            s = Setup(micro_batch_tokens=t, document_tokens=doc, activation_checkpointing="blocks" if blocks else "off")
            planned = activation_bytes(sh4, s)[s.activation_checkpointing]
            grads = 4 * sh4.params()  # the backward's weight gradients, which the plan counts apart
            got = r["peak"] - r["before"] - grads
            lines.append(f"| {t} | {t // doc} x {doc} | {'blocks' if blocks else 'off'} | {got / GIB:.3f} GiB "
                         f"| {planned / GIB:.3f} GiB | {planned / got:.2f} | "
                         f"{(r['before'] + grads + planned) / r['peak']:.2f} |")
    return lines


ARMS = ("off", "blocks", "heap")  # heap: blocks with glibc's allocator as it was


def timed_fb(tokens: int, arm: str, repeats: int) -> dict:
    """One forward and backward `repeats` times after a warm-up in this process. "blocks" as a run
    would: the allocator set as start.build sets it for blocks on a CPU; "heap": blocks with glibc's
    allocator left as it was (what floe did before it set it)."""
    import statistics
    import time
    model, batch = packed_model(4, tokens, DOCUMENT, arm != "off", mapped=arm == "blocks")
    times = []
    for rep in range(repeats + 1):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        model(*batch).sum().backward()
        if rep:  # rep 0 is the warm-up
            times.append(time.perf_counter() - t0)
    return {"median": statistics.median(times), "peak": peak_rss()}


def recompute(a) -> str:
    """Checkpointing's time: off, blocks, and blocks under glibc's defaults, each in its own process
    (blocks sets the process's allocator), rotating, `a.rounds` rounds of `a.repeats` timed repeats."""
    import statistics
    lines = [f"4 layers at Qwen3-0.6B widths, vocab {SMALL_VOCAB}, fp32, row attention, packed {DOCUMENT}-token "
             f"documents, torch {torch.__version__}, {torch.get_num_threads()} threads; a process per arm and round "
             f"(the median of {a.repeats} repeats after a warm-up), {a.rounds} rounds, the arms' order rotating; "
             "\"heap\": blocks with glibc's allocator as it was (start.map_large_buffers not called)", "",
             "| tokens | off | blocks | blocks / off | heap | heap / off | peak RSS: off, blocks, heap |", "|" + " --- |" * 7]
    for t in TOKENS:
        runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
        for rnd in range(a.rounds):
            for arm in ARMS[rnd % 3:] + ARMS[:rnd % 3]:
                runs[arm].append(child(["_time", str(t), arm, str(a.repeats), str(rnd)]))
        med = {arm: statistics.median(r["median"] for r in runs[arm]) for arm in ARMS}
        peaks = ", ".join(f"{max(r['peak'] for r in runs[arm]) / GIB:.2f}" for arm in ARMS)
        lines.append(f"| {t} | {med['off']:.3f} s | {med['blocks']:.3f} s | {med['blocks'] / med['off']:.2f} | "
                     f"{med['heap']:.3f} s | {med['heap'] / med['off']:.2f} | {peaks} GiB |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- start-up

def write_sharded(d: Path, shape: dict, shard_bytes: int = 500 * 2**20) -> Path:
    """A random model of `shape` as HF sharded bf16 files with model.safetensors.index.json, one tensor
    made at a time (never the whole model in fp32), once."""
    from safetensors.torch import save_file
    from tasks.textcodec import write_tokenizer
    if (d / "model.safetensors.index.json").is_file():
        return d
    d.mkdir(parents=True, exist_ok=True)
    write_tokenizer(d)
    args = ModelArgs(**shape, eos_token_id=2)
    (d / "config.json").write_text(json.dumps({**args.to_hf(), "torch_dtype": "bfloat16"}, indent=2))
    with torch.device("meta"):
        names = {k: v.shape for k, v in Transformer(args).state_dict().items()}
    groups, current = [], []  # the files' tensors, planned from the shapes: a file's tensors are made when it is written
    for k in names:
        current.append(k)
        if sum(2 * names[n].numel() for n in current) >= shard_bytes:
            groups, current = groups + [current], []
    groups += [current] if current else []
    g, weight_map, total = torch.Generator().manual_seed(0), {}, 0
    for i, keys in enumerate(groups):
        part = {k: (torch.ones(names[k]) if k.endswith("norm.weight") else torch.randn(names[k], generator=g) * 0.02)
                .to(torch.bfloat16) for k in keys}
        name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file(part, str(d / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
        total += sum(t.nbytes for t in part.values())
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return d


def small_run(model_dir: str, steps: int, out: Path) -> list[str]:
    """train.py's flags for the memory runs: the built-in engine on the CPU, no eval, tiny batches
    (what is measured is the model's weights, not the batch)."""
    return ["--model", model_dir, "--steps", str(steps), "--eval-every", "0", "--prompts-per-step", "2",
            "--group-size", "2", "--max-new-tokens", "8", "--micro-batch-tokens", "256", "--device", "cpu",
            "--engine", "torch", "--compile", "off", "--out-dir", str(out)]


def after_build(model_dir: str, rank: int, base_dtype: str = "fp32") -> None:
    """train.py until start.build returns, then the peak RSS and out: nothing of step 1 runs."""
    import train

    real = train.build

    def build(*a, **k):
        held = real(*a, **k)  # the built parts stay alive while the peak is read
        os.write(1, (json.dumps({"peak": peak_rss(), "rss": rss()}) + "\n").encode())  # fd 1: sys.stdout is muted
        os._exit(0 if held else 1)

    train.build = build
    flags = small_run(model_dir, 1, Path(model_dir).parent / f"run-r{rank}-w{os.environ.get('WORLD_SIZE', 1)}")
    sys.stdout, stdout = open(os.devnull, "w"), sys.stdout
    try:
        train.main(flags + (["--lora-rank", str(rank), "--base-dtype", base_dtype] if rank else []))
    finally:
        sys.stdout = stdout


def before_arithmetic(shape: Shape, rank: int, baseline: int, largest_file: int) -> tuple[int, str]:
    """What the start before the sharded load held on a CPU, on every rank: hfdir.load's fp32 state (which
    became the model), the open file's mapped bf16 pages, the built-in engine's fp32 deep copy."""
    n = shape.params()
    adapters = 4 * shape.adapter_params(rank, TARGETS) * 2 if rank else 0  # the trainer's and the engine's copy
    total = baseline + 4 * n + largest_file + 4 * n + adapters
    return total, (f"{baseline / GIB:.2f} baseline + 4 x {n / 1e6:.0f}M trainer + {largest_file / GIB:.2f} largest file mapped"
                   f" + 4 x {n / 1e6:.0f}M engine" + (f" + {adapters / GIB:.2f} adapters x 2" if rank else ""))


SHAPES = {"0.6b": QWEN3_06B, "1.7b": {**QWEN3_06B, "hidden_size": 2048, "intermediate_size": 6144}}  # Qwen3-1.7B: tied, 28 layers


def startup(a) -> str:
    d = Path(a.out) / ("qwen3-0.6b-shaped-bf16" if a.shape == "0.6b" else f"qwen3-{a.shape}-shaped-bf16")
    child(["_write", str(d), a.shape])  # in a child: a process's ru_maxrss passes to those it starts, so this one stays small
    shape = Shape.from_dir(d)
    baseline = child(["_baseline"])["peak"]
    largest_file = max(f.stat().st_size for f in d.glob("*.safetensors"))
    lines = [f"random Qwen3-{a.shape.upper()}-shaped checkpoint ({shape.params() / 1e9:.2f}B) in bf16, "
             f"{len(list(d.glob('*.safetensors')))} shard files; baseline (empty start) {baseline / GIB:.2f} GiB", "",
             "| run | ranks | peak RSS after build, each rank | before the sharded load (computed) | plan | plan's terms | "
             "plan / measured |", "|" + " --- |" * 7]
    for ranks, rank in a.runs or [(1, 0), (1, 16), (2, 0), (2, 16)]:
        peaks = [r["peak"] for r in (ranks_child(["_startup", str(d), str(rank), a.base_dtype], ranks) if ranks > 1
                                     else [child(["_startup", str(d), str(rank), a.base_dtype])])]
        before, how = before_arithmetic(shape, rank, baseline, largest_file)
        role = plan(shape, Setup(world=ranks, lora_rank=rank, base_dtype=a.base_dtype if rank else "fp32")).role("trainer rank")
        terms = (f"{role.parts['weights'] / GIB:.2f} shard + {role.parts['engine copy'] / GIB:.2f} engine + "
                 f"{4 * max(shape.largest_tensor(), shape.block_params()) / GIB:.2f} largest tensor + "
                 f"{role.parts['baseline'] / GIB:.2f} baseline")
        base = f", base {a.base_dtype}" if rank and a.base_dtype != "fp32" else ""
        lines.append(f"| {'full' if not rank else f'LoRA r{rank}'}{base} | {ranks} | "
                     f"{', '.join(f'{p / GIB:.2f}' for p in peaks)} GiB | {before / GIB:.2f} GiB = {how} | "
                     f"{role.startup / GIB:.2f} GiB | {terms} | {role.startup / max(peaks):.2f} |")
        print(lines[-1], flush=True)
    return "\n".join(lines)


# ----------------------------------------------------------------------------- save and resume

def reset_peak() -> None:
    """The kernel's peak RSS (VmHWM) set back to the current RSS: what follows is measured alone."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_since_reset() -> int:
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) * 1024 for x in f if x.startswith("VmHWM:"))


def trainer_model(model_dir: Path):
    """The trainer's model as run/start.py builds it: whole in one process, under torchrun sharded with
    each rank reading its rows (the sharded load); AdamW over it, its state filled as a step leaves it."""
    from run import hfdir
    from layers import parallel
    parallel.setup_distributed("cpu")
    if parallel.world() > 1:
        model = hfdir.load_meta(model_dir)[0]
        parallel.shard(model)
        hfdir.fill_shards(model, model_dir, {}, "cpu")
    else:
        model = hfdir.load(model_dir)
    opt = torch.optim.AdamW(model.parameters())
    for p in model.parameters():  # written, so every page is resident
        opt.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.full_like(p, 1e-3), "exp_avg_sq": torch.full_like(p, 1e-6)}
    return model, opt


def save_child(model_dir: str, out: str) -> None:
    """One checkpoint.save_checkpoint of the model with its AdamW state: each rank's RSS before it and its
    peak during it (VmHWM, reset just before)."""
    import random as rnd
    from run import checkpoint
    from layers import parallel
    model, opt = trainer_model(Path(model_dir))
    Path(out).mkdir(parents=True, exist_ok=True)
    before = rss()
    reset_peak()
    checkpoint.save_checkpoint(Path(out), 1, model, opt, rnd.Random(0), torch.Generator(), Path(model_dir))
    print(json.dumps({"rank": parallel.RANK, "before": before, "peak": peak_since_reset()}), flush=True)
    os._exit(0)


def resume_child(path: str) -> None:
    """A resume's reading of a checkpoint, from nothing: `whole` (one process: the weights whole; torchrun:
    the headers, then each rank its rows) and load_training_state (each rank its own optimizer file); the
    process's peak RSS after it. The engine is not built (its copy is the start-up's, measured there)."""
    import random as rnd
    import types
    from run import checkpoint
    from layers import parallel
    parallel.setup_distributed("cpu")
    model, _ = checkpoint.whole(Path(path))
    opt = torch.optim.AdamW(model.parameters())
    engine = types.SimpleNamespace(gen=torch.Generator(), load_weights=lambda *a, **k: None)
    checkpoint.load_training_state(Path(path), model, opt, rnd.Random(), engine)
    read = peak_rss()  # the AdamW tensors are still the file's pages (safetensors maps it), none read yet
    with torch.no_grad():
        for st in opt.state.values():  # as the first step finds them: written in place, so held by the process
            for t in st.values():
                t.mul_(1.0)
    print(json.dumps({"rank": parallel.RANK, "read": read, "peak": peak_rss()}), flush=True)
    os._exit(0)


def save_before(shape: Shape, ranks: int, baseline: int) -> tuple[int, int, str]:
    """What the save and the resume before this change held on rank 0's host (computed): the save gathered
    every weight (4) and AdamW tensor (8) whole on rank 0, serialized the optimizer state into one blob
    (8 more) and the weights into safetensors' buffer (4 more) while the blob was held; the resume loaded
    the whole model on every rank (4) and read the optimizer file's bytes (8) and its tensors (8) whole."""
    n = shape.params()
    own = 12 * n // ranks  # this rank's weights and AdamW state
    gathered = (12 * n - own) if ranks > 1 else 0  # one process: .cpu() of a CPU tensor is the tensor itself
    save = baseline + own + gathered + 8 * n + 4 * n
    resume = baseline + 4 * n + 16 * n
    return save, resume, (f"save: {baseline / GIB:.2f} baseline + {own / GIB:.2f} held + {gathered / GIB:.2f} gathered + "
                          f"{8 * n / GIB:.2f} optimizer blob + {4 * n / GIB:.2f} weights' buffer; resume: baseline + "
                          f"{4 * n / GIB:.2f} model + {16 * n / GIB:.2f} optimizer bytes and tensors")


def save_resume(a) -> str:
    d = Path(a.out) / "qwen3-0.6b-shaped-bf16"
    child(["_write", str(d)])
    shape = Shape.from_dir(d)
    baseline = child(["_baseline"])["peak"]
    n = shape.params()
    lines = [f"random Qwen3-0.6B-shaped checkpoint ({n / 1e6:.0f}M parameters), fp32 weights and AdamW state "
             f"(12 B a parameter, {12 * n / GIB:.2f} GiB in all); baseline (empty start) {baseline / GIB:.2f} GiB; "
             f"largest tensor {4 * shape.largest_tensor() / GIB:.2f} GiB fp32, one block {4 * shape.block_params() / GIB:.2f} GiB", "",
             "| ranks | rank | RSS before the save | peak during the save | save's own | peak of a resume (its "
             "AdamW state read; written once, as the first step does) "
             "| before this change (computed): save, resume | plan: shard + AdamW shard + memplan.save_bytes + baseline "
             "| plan: shard + AdamW shard + one tensor or block + baseline |", "|" + " --- |" * 9]
    for ranks in (1, 2):
        out = Path(a.out) / f"save-w{ranks}"
        import shutil
        shutil.rmtree(out, ignore_errors=True)
        saves = sorted((ranks_child(["_save", str(d), str(out)], ranks) if ranks > 1
                        else [child(["_save", str(d), str(out)])]), key=lambda r: r["rank"])
        resumes = sorted((ranks_child(["_resume", str(out / "step_000001")], ranks) if ranks > 1
                          else [child(["_resume", str(out / "step_000001")])]), key=lambda r: r["rank"])
        before_save, before_resume, how = save_before(shape, ranks, baseline)
        role = plan(shape, Setup(world=ranks)).role("trainer rank")
        planned = role.parts["weights"] + role.parts["AdamW state"] + save_bytes(shape, Setup(world=ranks)) + baseline
        staging = 4 * max(shape.largest_tensor(), shape.block_params())  # the load's one tensor or block, as start-up's
        resumed = role.parts["weights"] + role.parts["AdamW state"] + staging + baseline
        for s, r in zip(saves, resumes):
            lines.append(f"| {ranks} | {s['rank']} | {s['before'] / GIB:.2f} GiB | {s['peak'] / GIB:.2f} GiB | "
                         f"{(s['peak'] - s['before']) / GIB:.2f} GiB | {r.get('read', 0) / GIB:.2f}, {r['peak'] / GIB:.2f} GiB | "
                         f"{before_save / GIB:.2f}, {before_resume / GIB:.2f} GiB | {planned / GIB:.2f} GiB "
                         f"({planned / s['peak']:.2f} of the save's peak) | {resumed / GIB:.2f} GiB "
                         f"({resumed / r['peak']:.2f} of the resume's) |")
            print(lines[-1], flush=True)
        lines.append(f"| {ranks} | | | | | | {how} | | |")
    return "\n".join(lines)


def steady_child(model_dir: str, rank: int, base_dtype: str) -> None:
    """train.py for 3 steps with no checkpoint (the steps' memory, not a save's): each rank's peak RSS
    once step 3's optimizer step is done."""
    import train
    from layers import parallel

    def loop(run, start):
        real(run, start)
        os.write(1, (json.dumps({"rank": parallel.RANK, "peak": peak_rss()}) + "\n").encode())  # sys.stdout is muted
        os._exit(0)

    real, train.loop = train.loop, loop
    train.save_checkpoint = lambda *a, **k: None
    flags = small_run(model_dir, 3, Path(model_dir).parent / f"steady-r{rank}-{base_dtype}-w{os.environ.get('WORLD_SIZE', 1)}")
    import shutil
    shutil.rmtree(flags[-1], ignore_errors=True)
    sys.stdout = open(os.devnull, "w")
    train.main(flags + (["--lora-rank", str(rank), "--base-dtype", base_dtype] if rank else []))


def steady(a) -> str:
    """Each rank's peak RSS after step 3 beside the plan's per-rank total for the same flags."""
    d = Path(a.out) / "qwen3-0.6b-shaped-bf16"
    child(["_write", str(d)])
    shape = Shape.from_dir(d)
    lines = ["| run | ranks | peak RSS after step 3, each rank | plan's trainer rank | plan / measured |", "|" + " --- |" * 5]
    runs = [(r, k, t) for r in (1, 2) for k, t in ((0, "fp32"), (16, "fp32"), (16, "bf16"))] if a.runs is None else \
        [(r, k, a.base_dtype if k else "fp32") for r, k in a.runs]
    for ranks, rank, dtype in runs:
        args = ["_steady", str(d), str(rank), dtype]
        peaks = [r["peak"] for r in sorted(ranks_child(args, ranks) if ranks > 1 else [child(args)], key=lambda r: r["rank"])]
        role = plan(shape, Setup(world=ranks, lora_rank=rank, base_dtype=dtype, micro_batch_tokens=256)).role("trainer rank")
        lines.append(f"| {'full' if not rank else f'LoRA r{rank}, base {dtype}'} | {ranks} | "
                     f"{', '.join(f'{p / GIB:.2f}' for p in peaks)} GiB | {role.total / GIB:.2f} GiB | "
                     f"{role.total / max(peaks):.2f} |")
        print(lines[-1], flush=True)
    return "\n".join(lines)


def inference_child(model_dir: str) -> None:
    """train.py with --inference-gpus 1 for 2 steps, no checkpoint: the inference rank prints its peak
    RSS once its engine is built and once it served the run; the trainer ranks print nothing."""
    from run import remote
    import train

    def make_engine(*a, **k):
        engine = real_engine(*a, **k)
        at_start.append(peak_rss())
        return engine

    def serve(*a, **k):
        real_serve(*a, **k)
        os.write(1, (json.dumps({"start": at_start[0], "peak": peak_rss()}) + "\n").encode())  # sys.stdout is muted

    at_start, real_engine, real_serve = [], remote.make_engine, train.serve
    remote.make_engine, train.serve = make_engine, serve
    train.save_checkpoint = lambda *a, **k: None
    out = Path(model_dir).parent / "inference-run"
    import shutil
    shutil.rmtree(out, ignore_errors=True)
    sys.stdout = open(os.devnull, "w")
    train.main(small_run(model_dir, 2, out) + ["--inference-gpus", "1"])


def inference(a) -> str:
    """The inference rank's peak RSS against the plan's inference rank, and the two copies it held before."""
    d = Path(a.out) / "qwen3-0.6b-shaped-bf16"
    child(["_write", str(d)])
    shape = Shape.from_dir(d)
    baseline = child(["_baseline"])["peak"]
    r = ranks_child(["_inference", str(d)], 3)[0]
    role = plan(shape, Setup(world=2, inference_gpus=1)).role("inference rank")
    n = shape.params()
    before = baseline + 2 * n + 4 * n
    return "\n".join([
        "| inference rank | peak RSS | plan | plan / measured | before the streamed push (computed) |", "|" + " --- |" * 5,
        f"| engine built | {r['start'] / GIB:.2f} GiB | {role.startup / GIB:.2f} GiB (start-up) | {role.startup / r['start']:.2f} | "
        f"{before / GIB:.2f} GiB = {baseline / GIB:.2f} baseline + 2 x {n / 1e6:.0f}M wire copy + 4 x {n / 1e6:.0f}M engine |",
        f"| 2 steps served | {r['peak'] / GIB:.2f} GiB | {role.total / GIB:.2f} GiB | {role.total / r['peak']:.2f} | |"])


# ----------------------------------------------------------------------------- the plan on CUDA

def cuda_step(a) -> str:
    """The plan against torch.cuda.max_memory_allocated on CUDA: one training step (forward, the fused
    head, backward, AdamW) of a random Qwen3-0.6B-shaped model in fp32 at 4k and 16k tokens of packed
    1k-token documents, checkpointing off and blocks. The plan's side is the trainer rank less the
    engine and the CUDA context (neither is in torch's allocator here); an OOM is a row too."""
    from kernels import head
    shape = Shape(ModelArgs(**QWEN3_06B))
    lines = [f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, Qwen3-0.6B shape, fp32, flex attention", "",
             "| tokens | checkpointing | max_memory_allocated | plan (no engine, no context) | plan / measured |",
             "|" + " --- |" * 5]
    for tokens in (4096, 16384):
        for blocks in (False, True):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            try:
                model = Transformer(shape.args).cuda()
                model.checkpointing = blocks
                opt = torch.optim.AdamW(model.parameters())
                ids = torch.randint(0, shape.args.vocab_size, (tokens,), device="cuda")
                at = torch.arange(tokens, device="cuda")
                logp = head(model(ids, at % 1024, at // 1024), model.head_weight, ids.roll(-1))[0]
                (-logp.mean()).backward()
                opt.step()
                peak = torch.cuda.max_memory_allocated()
            except torch.OutOfMemoryError:
                peak = 0
            model = opt = logp = None
            role = plan(shape, Setup(device="cuda", micro_batch_tokens=tokens,
                                         activation_checkpointing="blocks" if blocks else "off")).role("trainer rank")
            planned = role.total - role.parts["engine copy"] - role.parts["baseline"]
            lines.append(f"| {tokens} | {'blocks' if blocks else 'off'} | {f'{peak / GIB:.2f} GiB' if peak else 'OOM'} | "
                         f"{planned / GIB:.2f} GiB | {f'{planned / peak:.2f}' if peak else '-'} |")
            print(lines[-1], flush=True)
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the scale table

# the model cards' config.json shapes (Qwen/Qwen3-*): all with vocab 151936 and 128-wide heads
QWEN3 = {"Qwen3-1.7B": (2048, 6144, 28, 16, 8, True), "Qwen3-8B": (4096, 12288, 36, 32, 8, False),
         "Qwen3-14B": (5120, 17408, 40, 40, 8, False), "Qwen3-32B": (5120, 25600, 64, 64, 8, False)}


def qwen3(name: str) -> Shape:
    h, i, layers, heads, kv, tied = QWEN3[name]
    return Shape.from_config(dict(model_type="qwen3", vocab_size=151936, hidden_size=h, intermediate_size=i,
                                    num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                                    head_dim=128, tie_word_embeddings=tied))


def scale(a) -> str:
    """docs/scale.md's table: the plan (computed, not measured) for 8 GPUs, each a trainer rank with
    a colocated bf16 built-in engine, fp32 training, 16k-token micro-batches."""
    lines = ["| model | params | fine-tuning | checkpointing | per GPU: weights + grads + AdamW | engine | activations "
             "| total | start-up | 8xH100-80GB | 8xH200 |", "|" + " --- |" * 11]
    for name in QWEN3:
        shape = qwen3(name)
        for rank in (0, 16):
            for ac in ("off", "blocks"):
                s = Setup(world=8, lora_rank=rank, device="cuda", micro_batch_tokens=16384, activation_checkpointing=ac)
                t = plan(shape, s).role("trainer rank")
                state = t.parts["weights"] + t.parts["gradients"] + t.parts["AdamW state"]
                fit = lambda d: "fits" if fits(shape, s, DEVICES[d]) else "no"  # noqa: E731
                lines.append(f"| {name} | {shape.params() / 1e9:.2f}B | {'LoRA r16' if rank else 'full'} | {ac} "
                             f"| {state / GIB:.1f} GiB | {t.parts['engine copy'] / GIB:.1f} GiB "
                             f"| {t.parts['activations'] / GIB:.1f} GiB | {t.total / GIB:.1f} GiB "
                             f"| {t.startup / GIB:.1f} GiB | {fit('H100-80GB')} | {fit('H200')} |")
    return "\n".join(lines)


def run_spec(text: str) -> tuple[int, int]:
    ranks, _, rank = text.partition("x")
    return int(ranks), int(rank)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0].startswith("_"):
        if argv[0] == "_baseline":
            import train  # noqa: F401  (the imports are the baseline)
            r = {"peak": peak_rss()}
        elif argv[0] == "_fb":
            r = forward_backward(int(argv[1]), int(argv[2]), int(argv[3]), argv[4] == "1")
        elif argv[0] == "_time":  # the last argument (the round) only keeps child() from reusing a figure
            r = timed_fb(int(argv[1]), argv[2], int(argv[3]))
        elif argv[0] == "_head":
            r = head_tiles(int(argv[1]))
        elif argv[0] == "_write":
            r = {"dir": str(write_sharded(Path(argv[1]), SHAPES[argv[2] if len(argv) > 2 else "0.6b"]))}
        elif argv[0] == "_save":
            return save_child(argv[1], argv[2])
        elif argv[0] == "_resume":
            return resume_child(argv[1])
        elif argv[0] == "_inference":
            return inference_child(argv[1])
        elif argv[0] == "_steady":
            return steady_child(argv[1], int(argv[2]), argv[3])
        else:
            return after_build(argv[1], int(argv[2]), *argv[3:4])
        print(json.dumps(r))
        return None
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("study", choices=["baseline", "activations", "recompute", "startup", "save", "steady", "inference", "scale",
                                           "cuda"])
    ap.add_argument("--out", default="runs/memory")
    ap.add_argument("--repeats", type=int, default=3, help="recompute: timed repeats in each process")
    ap.add_argument("--rounds", type=int, default=3, help="recompute: rounds, a process per arm each")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.6b", help="startup: the random checkpoint's shape")
    ap.add_argument("--runs", type=run_spec, nargs="+", default=None,
                    help="startup, steady: RANKSxLORA_RANK each (0: full fine-tuning), e.g. 2x16; startup's default "
                         "1x0 1x16 2x0 2x16, steady's those with both base dtypes")
    ap.add_argument("--base-dtype", choices=["fp32", "bf16"], default="fp32", help="startup, steady: LoRA runs' --base-dtype")
    a = ap.parse_args(argv)
    if a.study == "baseline":
        print(f"empty start: peak RSS {child(['_baseline'])['peak']} bytes")
    else:
        print({"activations": activations, "recompute": recompute, "startup": startup, "save": save_resume, "steady": steady,
               "inference": inference, "scale": scale, "cuda": cuda_step}[a.study](a))


if __name__ == "__main__":
    main()
