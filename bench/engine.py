"""Rollout throughput of the two engines, side by side: the built-in TorchEngine and vLLM.

    python bench/engine.py                          # the shipped tiny model, CPU (or the GPU if there is one)
    python bench/engine.py --model DIR --prompts 64 # any HF Qwen3 directory
    python bench/engine.py --lora-rank 8            # LoRA: vLLM serving the adapter against merged pushes

What is timed: `engine.generate(prompts, n, sampling)` alone, the call train.py makes each
step, at the training defaults (reverse-text prompts, 16 samples each, temperature 1, 24
new tokens, --dtype bf16 engine weights). Rows: without support capture, and with it (what a
centered loss like --loss icepop asks for: K = 16 draws per token from the built-in engine,
the whole distribution per token from vLLM on a small vocabulary; with --top-k both
report the kept set). tok/s counts completion tokens (the stop token included) over the
median wall time of --repeats (7) calls, the two rows' calls taking turns after one
warm-up call each (a call lasts until its longest sample stops, so single calls vary
widely). Engine start-up (vLLM loads the directory and reserves its KV cache) is
printed separately, not in the rate.

With --lora-rank r the model gets rank-r adapters on every linear layer (B drawn, so they
change what is sampled) and the rows are the engines a LoRA run can use: the built-in engine
and vLLM with --lora-merged (merged weights pushed), and vLLM serving the adapter (enable_lora).

Simplifications:
1. One process runs the engines in turn; vLLM runs in this process (as in train.py),
   so they share the machine's cores exactly as they would in training. A vLLM engine is shut
   down before the next one starts.
2. vLLM is skipped, and says so, when it does not import.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


from engines.torch_engine import Sampling, TorchEngine  # noqa: E402
from engines.vllm_engine import VLLMEngine  # noqa: E402
from layers.lora import LoRASpec, TARGETS, adapted, add  # noqa: E402
from run import hfdir  # noqa: E402
from tasks.task import ReverseText  # noqa: E402
from tasks.textcodec import TextCodec  # noqa: E402


def timed(engine, prompts, n, settings, repeats):
    """Median seconds per call and tokens of the last call, per setting. The settings take turns
    (round-robin, after one warm-up call each), so drift over the run hits them alike."""
    for s in settings:
        engine.generate(prompts, n, s)  # warm-up: first-call allocations, vLLM's profiling
    times, tokens = [[] for _ in settings], [0] * len(settings)
    for _ in range(repeats):
        for i, s in enumerate(settings):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t = time.perf_counter()
            out = engine.generate(prompts, n, s)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times[i].append(time.perf_counter() - t)
            tokens[i] = sum(len(c.ids) for c in out)
    return [(tok, statistics.median(ts)) for tok, ts in zip(tokens, times)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "checkpoints" / "reverse-tiny"))
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--vllm-memory", type=float, default=0.2)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="the engines' weights")
    ap.add_argument("--lora-rank", type=int, default=0, help="adapters of this rank on every linear layer (0: none)")
    a = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = hfdir.load(a.model, device=device)
    if a.lora_rank:
        add(model, LoRASpec(a.lora_rank, 32.0, tuple(sorted(TARGETS))))
        torch.manual_seed(0)
        with torch.no_grad():
            for m in adapted(model).values():
                m.lora_B.weight.normal_(0, 0.02)
    codec = TextCodec.load(a.model)
    task = ReverseText(codec, min_words=1, max_words=3, eval_size=8)  # keywords: a reward list comes second now
    prompts = [p.ids for p in task.sample(a.prompts, random.Random(0))]
    settings = [("off", Sampling(top_k=a.top_k, max_new_tokens=a.max_new_tokens)),
                ("on", Sampling(top_k=a.top_k, max_new_tokens=a.max_new_tokens, support=True))]
    print(f"# {Path(a.model).name}, V={model.args.vocab_size}, {device}, torch threads {torch.get_num_threads()}, "
          f"{a.prompts} prompts x {a.n} samples, {a.max_new_tokens} new tokens, top-k {a.top_k or 'off'}, {a.dtype} engines")
    rows = []
    engines = [("torch" + " (merged)" * bool(a.lora_rank),
                lambda: TorchEngine(model, a.dtype, codec.stop_ids, seed=0, compile_step=device == "cuda"))]
    if importlib.util.find_spec("vllm"):
        def vllm(lora=None):
            return VLLMEngine(a.model, model.args.vocab_size, a.dtype, codec.stop_ids, 0, a.vllm_memory, device,
                              model.args.max_position_embeddings, lora=lora)
        engines.append(("vllm" + " (merged)" * bool(a.lora_rank), vllm))
        if a.lora_rank:
            engines.append(("vllm (adapter)", lambda: vllm(model.lora)))
    else:
        print("# vllm does not import here: its rows are missing")
    for name, make in engines:
        t = time.perf_counter()
        engine = make()
        if a.lora_rank:  # the drawn adapter: merged, or vLLM's first adapter load (counted in start-up)
            engine.load_weights(model, 1)
        start = time.perf_counter() - t
        results = timed(engine, prompts, a.n, [s for _, s in settings], a.repeats)
        for (support, _), (tokens, dt) in zip(settings, results):
            rows.append((name, f"{start:.1f}", support, tokens, f"{dt:.3f}", f"{tokens / dt:,.0f}"))
        if isinstance(engine, VLLMEngine):
            engine.llm.llm_engine.engine_core.shutdown()  # its memory back before the next one starts
        del engine
    head = ("engine", "start s", "support", "tokens/call", "s/call", "tok/s")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in rows:
        print("| " + " | ".join(str(x) for x in r) + " |")


if __name__ == "__main__":
    main()
