"""LoRA against full fine-tuning: what it learns, what it holds in memory, what a push moves.

Three studies, each printing a markdown table (docs/experiments.md keeps the measured ones):
- `learn`: the default reverse-text job (train.py's defaults, 80 steps) with full fine-tuning and
  with `--lora-rank 8` at its own learning rate, over --seeds seeds each: the held-out reward at
  step 0 and at the end (mean ± std), LoRA's gap to full (paired by seed) and the wall time.
  `--arms linears` adds full fine-tuning of the adapted layers alone (the embedding, its tied head
  and the norms frozen, as LoRA leaves them): what the parameters LoRA never trains account for.
  Each run is `train.main` in this process, one after another (bench/experiment.py's run_one).
  `--arms lora-bf16 --bf16-start` measures `--base-dtype bf16` against the fp32 base: both start
  from reverse-tiny rounded to bf16, so the two hold the same base and differ only in its dtype.
- `memory`: a random model of a given shape (Qwen3-0.6B's by default) trained a few steps on the
  CPU, full and at each --ranks, each configuration in a fresh process of its own (its peak RSS
  is its own): the trainer's state counted from its tensors (weights, gradients, AdamW state),
  the colocated engine's copy, the process's peak RSS (which holds both), and what one push hands
  the engine (full: every tensor in the engine's dtype, as a remote push broadcasts; LoRA: the
  adapter in fp32) with the time the built-in engine takes to load it. `--device cuda` (bench/gpu.sh)
  trains on the GPU and reports its peak allocated memory (trainer and engine copy) instead of RSS.
- `engine`: the two ways a bf16 engine can serve an adapter, on a trained one: merged (floe's
  TorchEngine: W + (alpha / r) B A rounded once to bf16, requantized per push) and on the fly
  (the bf16 base and the bf16 adapter, x W^T + s (x A^T) B^T with each matmul's output rounded,
  as vLLM's LoRA kernels compute): the push's time, a rollout's time, and the mismatch KL(q || p)
  against the fp32 trainer over the rollout's tokens.

Simplifications:
1. Sequential, on the CPU: parallel runs would share two cores and corrupt the timings.
2. `memory` counts bytes from the live tensors (exact) and reads peak RSS from the kernel
   (everything the process held at its worst moment, Python and the allocator's slack included).
   It measures the steps: the run writes no checkpoint (safetensors builds a checkpoint's bytes
   in memory, which for full fine-tuning adds the AdamW state's size again at that moment).
3. The on-the-fly engine exists here only, as a measurement: floe's engines merge.

    python bench/lora.py learn --seeds 3 --lora-lr 3e-3 --arms full,linears,lora   # 9 runs of the default job, ~1.5 min each
    python bench/lora.py learn --seeds 3 --arms lora,lora-bf16 --bf16-start --out runs/lora-bf16  # the bf16 base
    python bench/lora.py learn --seeds 1 --arms lora --lora-lr 1e-3,3e-3,5e-3,1e-2  # a learning-rate sweep
    python bench/lora.py memory                                   # Qwen3-0.6B-shaped: full, ranks 8 and 64 (~14 GiB for full)
    python bench/lora.py memory --device cuda                     # the same on a GPU (bench/gpu.sh)
    python bench/lora.py engine --adapter runs/lora/lora-r8-lr3e-3-s0/final
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402


from engines.kvcache import KVCache  # noqa: E402
from model import ModelArgs, Transformer, init_weights  # noqa: E402
from layers import lora  # noqa: E402
from run import hfdir, start  # noqa: E402
from tasks.textcodec import TextCodec, write_tokenizer  # noqa: E402
import train  # noqa: E402
from experiment import _mean_std, _ms, run_one, run_stats  # noqa: E402
from engines.precision import Rounded  # noqa: E402
from engines.torch_engine import Sampling, TorchEngine  # noqa: E402

QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=512)


def load() -> str:
    return "load average " + " ".join(f"{x:.1f}" for x in os.getloadavg())


# ----------------------------------------------------------------------------- learn

@contextlib.contextmanager
def linears_only():
    """Full fine-tuning of the layers LoRA adapts and nothing else (the embedding, its tied head and
    the norms frozen): a diagnosis that exists here only, for what LoRA's frozen parameters hold."""
    real = start.shard

    def shard(model):
        model.requires_grad_(False)
        for name, layer in model.named_modules():
            if isinstance(layer, nn.Linear) and name.split(".")[-1] in lora.TARGETS:
                layer.requires_grad_(True)
        real(model)

    start.shard = shard
    try:
        yield
    finally:
        start.shard = real


def learn(a) -> str:
    arms = {"full": [("full", lr, []) for lr in a.full_lr.split(",")],
            "linears": [("full-linears", lr, []) for lr in a.full_lr.split(",")],
            "lora": [(f"lora-r{a.rank}", lr, ["--lora-rank", str(a.rank)]) for lr in a.lora_lr.split(",")],
            "lora-bf16": [(f"lora-r{a.rank}-bf16base", lr, ["--lora-rank", str(a.rank), "--base-dtype", "bf16"])
                          for lr in a.lora_lr.split(",")]}
    runs = [r for arm in a.arms.split(",") for r in arms[arm]]
    start_from = ["--model", str(bf16_copy(Path(a.out) / "start-bf16"))] if a.bf16_start else []
    stats, t0, begin = {}, time.perf_counter(), load()
    for name, lr, flags in runs:
        for seed in range(a.seeds):
            run_dir = Path(a.out) / f"{name}-lr{lr}-s{seed}"
            args = [*flags, *start_from, "--lr", lr, "--seed", str(seed), "--steps", str(a.steps), "--out-dir", str(run_dir),
                    *shlex.split(a.extra)]
            with linears_only() if name == "full-linears" else contextlib.nullcontext():
                result = run_one(args, run_dir)
            r = run_stats("icepop", run_dir, result["wall_s"])
            stats.setdefault((name, lr), []).append(r)
            print(f"{run_dir.name}: eval reward {r['eval0']:.3f} -> {r['eval']:.3f}, {r['wall_s']:.0f} s", flush=True)
    full = next((v for (n, _), v in stats.items() if n == "full"), None)
    lines = [f"{a.steps} steps, seeds 0..{a.seeds - 1}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
             f"{begin} at the start, {load()} at the end, {(time.perf_counter() - t0) / 60:.0f} min in all", "",
             "| run | lr | reward @0 | reward, final | vs full (paired) | mismatch kl | wall s/run |",
             "|" + " --- |" * 7]
    for (name, lr), rs in stats.items():
        g = None if full is None or rs is full else _mean_std([r["eval"] - f["eval"] for r, f in zip(rs, full)])
        lines.append(f"| {name} | {lr} | {_ms([r['eval0'] for r in rs])} | {_ms([r['eval'] for r in rs])} "
                     f"| {'-' if g is None else f'{g[0]:+.3f} ± {g[1]:.3f}'} "
                     f"| {statistics.fmean(r['kl'] for r in rs):.2e} | {statistics.fmean(r['wall_s'] for r in rs):.0f} |")
    return "\n".join(lines)


def bf16_copy(out: Path, src: Path = ROOT / "checkpoints" / "reverse-tiny") -> Path:
    """`src` with every weight rounded to bf16 and stored in fp32: a start on which `--base-dtype
    bf16` and fp32 hold the same base, as they do for a real checkpoint stored in bf16."""
    import shutil
    from safetensors.torch import load_file, save_file
    if out.is_dir():
        shutil.rmtree(out)
    shutil.copytree(src, out)
    weights = load_file(str(src / "model.safetensors"))
    save_file({k: v.to(torch.bfloat16).float() for k, v in weights.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out


# ----------------------------------------------------------------------------- memory

def shaped_model(d: Path, shape: dict) -> Path:
    """A random model of `shape` as a HF directory (fp32), made once."""
    if (d / "model.safetensors").is_file():
        return d
    d.mkdir(parents=True, exist_ok=True)
    write_tokenizer(d)
    codec = TextCodec.load(d)
    m = Transformer(ModelArgs(**shape, eos_token_id=codec.stop_ids[0]))
    init_weights(m, std=0.02, seed=0)
    hfdir.save(m, d, d)
    return d


def nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def best_of(n: int, fn) -> float:
    """The fastest of n calls of fn, in seconds."""
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure_child(model_dir: str, rank: int, steps: int, device: str = "cpu") -> None:
    """One configuration, in this (fresh) process: train `steps` steps, then count and time; a JSON line."""
    seen = {}

    def loop(run, start):
        real(run, start)
        params = list(run.model.parameters())
        trained = [p for p in params if p.requires_grad]
        engine = run.engine.model.state_dict()
        payload = (nbytes(lora.adapter_state(run.model).values()) if run.model.lora is not None
                   else sum(v.numel() for v in engine.values()) * torch.finfo(run.engine.dtype).bits // 8)
        push_s = best_of(3, lambda: run.engine.load_weights(run.model, version=steps))
        seen.update(params=sum(p.numel() for p in params), trained=sum(p.numel() for p in trained),
                    weights=nbytes(params), grads=nbytes(trained),
                    adam=nbytes(t for st in run.opt.state.values() for t in st.values() if t.dim()),
                    engine=nbytes(engine.values()), push_bytes=payload, push_s=push_s,
                    step_s=statistics.fmean(r["time/step"] for r in run.log.rows if "time/step" in r))

    real, train.loop = train.loop, loop
    train.save_checkpoint = lambda *a, **k: None  # the steps' memory, not a checkpoint's (its bytes are built in memory)
    flags = ["--model", model_dir, "--steps", str(steps), "--eval-every", "0", "--prompts-per-step", "2",
             "--group-size", "2", "--max-new-tokens", "8", "--micro-batch-tokens", "256", "--lr", "1e-4",
             "--device", device, "--engine", "torch", "--compile", "off"]  # the built-in engine's copy is counted
    out = Path(model_dir).parent / f"run-r{rank}"
    if rank:
        flags += ["--lora-rank", str(rank)]
    import shutil
    shutil.rmtree(out, ignore_errors=True)
    sys.stdout, stdout = open(os.devnull, "w"), sys.stdout
    train.main([*flags, "--out-dir", str(out)])
    sys.stdout = stdout
    seen["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if device == "cuda":  # the trainer and the colocated built-in engine share the one GPU
        seen["peak_gpu"] = torch.cuda.max_memory_allocated()
    print(json.dumps(seen))


def memory(a) -> str:
    d = shaped_model(Path(a.out) / "qwen3-0.6b-shaped", QWEN3_06B)
    gib = 2**30
    peak = "peak GPU memory allocated" if a.device == "cuda" else "peak RSS"
    lines = [f"Qwen3-0.6B-shaped random model on {a.device} ({a.steps} steps each, one process each; {load()})", "",
             "| run | trained params | trainer state (weights + grads + AdamW) | bytes/param | engine copy "
             f"| {peak} (engine included) | push payload | push time | step time |", "|" + " --- |" * 9]
    for rank in [int(r) for r in a.ranks.split(",")]:
        r = subprocess.run([sys.executable, __file__, "_child", str(d), str(rank), str(a.steps), a.device], capture_output=True,
                           text=True, cwd=ROOT)
        if r.returncode:
            raise SystemExit(f"rank {rank}: exit {r.returncode} {r.stderr[-2000:]}")
        m = json.loads(r.stdout.strip().splitlines()[-1])
        state = m["weights"] + m["grads"] + m["adam"]
        lines.append(f"| {'full' if not rank else f'LoRA r{rank}'} | {m['trained'] / 1e6:.2f}M of {m['params'] / 1e6:.0f}M "
                     f"| {state / gib:.2f} GiB | {state / m['params']:.2f} | {m['engine'] / gib:.2f} GiB "
                     f"| {m.get('peak_gpu', m['peak_rss']) / gib:.2f} GiB | {m['push_bytes'] / 2**20:.1f} MiB | {m['push_s']:.2f} s (best of 3) "
                     f"| {m['step_s']:.1f} s |")
        print(lines[-1], flush=True)
    return "\n".join(lines)


# ----------------------------------------------------------------------------- engine

class OnTheFly(nn.Module):
    """A bf16 engine's adapted layer served on the fly: the base and the adapter held in bf16, each
    matmul's output rounded to bf16 (emulated in fp32 on the CPU, as precision.Rounded)."""

    def __init__(self, layer: Rounded, a: torch.Tensor, b: torch.Tensor, scale: float):
        super().__init__()
        self.weight, self.bias, self.dtype, self.scale = layer.weight, layer.bias, layer.dtype, scale
        self.a, self.b = nn.Parameter(a.clone(), requires_grad=False), nn.Parameter(b.clone(), requires_grad=False)
        self.push(a, b)

    @torch.no_grad()
    def push(self, a: torch.Tensor, b: torch.Tensor) -> None:
        self.a.copy_(a.to(self.dtype).float())
        self.b.copy_(b.to(self.dtype).float())

    def forward(self, x):
        r = self.dtype
        x = x.to(r).float()
        y = F.linear(x, self.weight, self.bias).to(r).float()
        t = F.linear(x, self.a).to(r).float()
        return (y + self.scale * F.linear(t, self.b)).to(r).float()


def on_the_fly(model: Transformer) -> TorchEngine:
    """A bf16 TorchEngine whose adapted layers keep the base (rounded once) and apply the adapter live."""
    engine = TorchEngine(model, "bf16", [0])
    base = lora.base_state(model)
    adapter = lora.adapter_state(model)
    for name in lora.adapted(model):
        parent, _, child = name.rpartition(".")
        layer = engine.model.get_submodule(name)
        with torch.no_grad():
            layer.weight.copy_(base[f"{name}.weight"].to(torch.bfloat16).float())
        live = OnTheFly(layer, adapter[lora.peft_key(name, "A")], adapter[lora.peft_key(name, "B")], model.lora.scale)
        setattr(engine.model.get_submodule(parent), child, live)
    return engine


def push_on_the_fly(engine: TorchEngine, model: Transformer) -> None:
    adapter = lora.adapter_state(model)
    for name in lora.adapted(model):
        engine.model.get_submodule(name).push(adapter[lora.peft_key(name, "A")], adapter[lora.peft_key(name, "B")])


def mismatch(engine: TorchEngine, model: Transformer, completions, prompts) -> float:
    """Mean KL(q || p) over the completions' tokens: q the engine's next-token distribution, p the
    fp32 trainer's, both from one full forward of prompt + completion."""
    kls = []
    with torch.no_grad():
        for i, c in list(enumerate(completions))[::4]:  # every 4th: 128 of the 512
            ids = torch.tensor(prompts[i // 16] + c.ids)
            n = len(ids)
            p = (model(ids, torch.arange(n), torch.zeros(n, dtype=torch.long)) @ model.head_weight.T).log_softmax(-1)
            cache = KVCache(engine.model.args, 1, n, torch.float32, "cpu")
            q = engine._logits(engine.model.forward_cached(ids[None], torch.arange(n)[None], cache)[0]).log_softmax(-1)
            s = len(prompts[i // 16]) - 1
            kls.append((q.exp() * (q - p)).sum(-1)[s:-1].mean())  # the positions that drew a completion token
    return float(torch.stack(kls).mean())


def engine_bench(a) -> str:
    spec, tensors, base = lora.read_adapter(a.adapter)
    model = hfdir.load(base)
    lora.add(model, spec)
    lora.load_adapter(model, tensors)
    codec = TextCodec.load(base)
    import random
    from tasks.task import ReverseText
    task = ReverseText(codec, eval_size=4)
    prompts = [p.ids for p in task.sample(32, random.Random(0))]
    s = Sampling(max_new_tokens=24)
    lines = [f"{a.adapter} (rank {spec.rank}, alpha {spec.alpha:g}) on {base}; 32 prompts x 16 completions; {load()}", "",
             "| bf16 engine | push | rollout (32 x 16) | mismatch KL(q‖p) vs fp32 trainer |", "| --- | --- | --- | --- |"]
    for name, make, push in (("merged (floe)", lambda: TorchEngine(model, "bf16", codec.stop_ids), None),
                             ("on the fly", lambda: on_the_fly(model), push_on_the_fly)):
        engine = make()
        engine.stop_ids = torch.tensor(codec.stop_ids)
        t_push = best_of(5, lambda: engine.load_weights(model, 0) if push is None else push(engine, model))
        times = []
        for _ in range(3):
            engine.gen.manual_seed(0)
            t0 = time.perf_counter()
            out = engine.generate(prompts, 16, s)
            times.append(time.perf_counter() - t0)
        kl = mismatch(engine, model, out, prompts)
        lines.append(f"| {name} | {t_push * 1e3:.1f} ms (best of 5) | {min(times):.2f} s (best of 3) | {kl:.2e} |")
        print(lines[-1], flush=True)
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "_child":
        return measure_child(argv[1], int(argv[2]), int(argv[3]), argv[4])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="study", required=True)
    p = sub.add_parser("learn")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--full-lr", default="5e-4", help="full fine-tuning's --lr (train.py's rl default)")
    p.add_argument("--lora-lr", default="3e-3", help="LoRA's --lr (train.py's LoRA default); a comma-separated list sweeps")
    p.add_argument("--arms", default="full,lora", help="of full, lora, lora-bf16 (--base-dtype bf16) and linears "
                   "(full fine-tuning of the layers LoRA adapts alone: embedding, head and norms frozen), comma-separated")
    p.add_argument("--bf16-start", action="store_true", help="start every run from reverse-tiny rounded to bf16 "
                   "(stored in fp32), so that a bf16 base loses nothing against an fp32 one")
    p.add_argument("--extra", default="", help="more train.py flags for every run")
    p.add_argument("--out", default="runs/lora")
    p = sub.add_parser("memory")
    p.add_argument("--ranks", default="0,8,64", help="0: full fine-tuning")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--out", default="runs/lora-memory")
    p = sub.add_parser("engine")
    p.add_argument("--adapter", required=True, help="a LoRA run's step directory (its adapter, on its base)")
    a = ap.parse_args(argv)
    print({"learn": learn, "memory": memory, "engine": engine_bench}[a.study](a))


if __name__ == "__main__":
    main()
