"""End to end on one device: a randomly initialised Qwen3-0.6B-shaped model (no download)
through train.py's RL loop, printing rollout and train tokens/s and the trainer's MFU.

    python bench/e2e.py                      # CUDA: the 0.6B shape; CPU: a scaled-down shape it names
    python bench/e2e.py --shape cpu --steps 3
    python bench/e2e.py --train-dtype bf16   # the trainer's matmuls in bf16

The model has Qwen3-0.6B's shape (hidden 1024, 28 layers, 16 query / 8 KV heads of 128,
MLP 3072, vocabulary 151,936, tied embeddings), random weights and floe's character
tokenizer, so its completions never stop early: every sample runs --max-new-tokens, a
fixed amount of work per step. Step 1 (compilation, first allocations) is left out of
the rates; the rest come from metrics.jsonl:
- rollout tok/s: completion tokens (samples x mean length) / time/rollout;
- train tok/s: packed tokens (micro-batches x --micro-batch-tokens, padding included:
  that is the work done) / time/train;
- MFU: 6 x parameters x train tokens / time/train / peak, the usual dense estimate
  (attention's T^2 term left out; short sequences). Peak is the H200's dense bf16 figure
  from NVIDIA's sheet (989 TFLOP/s), whatever --train-dtype: with fp32 (the default, exact
  fp32 matmuls) the figure says how far that is from the hardware; bf16 (autocast and a
  bf16 head, fp32 weights) is the comparable one. On a CPU no peak is known and MFU is
  not printed.

Simplifications: one process, the engine train.py picks (`--engine auto`: vLLM on a GPU
when it imports, else the built-in engine); eval off; the model directory is written to
a temporary folder and removed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


from model import ModelArgs, Transformer, init_weights  # noqa: E402
from run import hfdir  # noqa: E402
from tasks.textcodec import TextCodec, write_tokenizer  # noqa: E402
import train  # noqa: E402

SHAPES = {
    "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, max_position_embeddings=4096),
    "cpu": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=64, max_position_embeddings=512),
}
PEAK_BF16 = {"H200": 989e12, "H100": 989e12}


def write_model(d: Path, shape: str) -> int:
    write_tokenizer(d)
    stop = TextCodec.load(d).stop_ids[0]
    m = Transformer(ModelArgs(151936, **SHAPES[shape], tie_word_embeddings=True, eos_token_id=stop))
    init_weights(m, seed=0)
    hfdir.save(m, d, d)
    return sum(p.numel() for p in m.parameters())


def main():
    cuda = torch.cuda.is_available()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.6b" if cuda else "cpu")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompts-per-step", type=int, default=32 if cuda else 4)
    ap.add_argument("--group-size", type=int, default=16 if cuda else 4)
    ap.add_argument("--max-new-tokens", type=int, default=128 if cuda else 16)
    ap.add_argument("--micro-batch-tokens", type=int, default=8192 if cuda else 1024)
    ap.add_argument("--engine", default="auto")
    ap.add_argument("--train-dtype", choices=["fp32", "bf16"], default="fp32")
    ap.add_argument("--compile", choices=["auto", "on", "off"], default="auto")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        d, out = Path(tmp) / "model", Path(tmp) / "run"
        d.mkdir()
        params = write_model(d, a.shape)
        train.main(["--model", str(d), "--steps", str(a.steps), "--eval-every", "0", "--engine", a.engine,
                    "--prompts-per-step", str(a.prompts_per_step), "--group-size", str(a.group_size),
                    "--max-new-tokens", str(a.max_new_tokens), "--micro-batch-tokens", str(a.micro_batch_tokens),
                    "--loss", "icepop", "--top-k", "64", "--train-dtype", a.train_dtype, "--compile", a.compile,
                    "--out-dir", str(out)])
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        cfg = json.loads((out / "config.json").read_text())
    rows = [r for r in rows if r.get("step", 0) >= 2] or rows  # step 1 compiles and allocates
    samples = a.prompts_per_step * a.group_size
    roll_tok = sum(r["length"] * samples for r in rows)
    roll_s = sum(r["time/rollout"] for r in rows)
    train_tok = sum(r["tokens/packed"] for r in rows)
    train_s = sum(r["time/train"] for r in rows)
    name = torch.cuda.get_device_name(0) if cuda else "cpu"
    peak = next((v for k, v in PEAK_BF16.items() if k in name), None)
    print(f"# {a.shape} shape, {params / 1e6:.0f}M params, {name}, engine {cfg['engine']}, train {cfg['train_dtype']}, compile {cfg['compile']}, "
          f"{a.prompts_per_step} x {a.group_size} samples x {a.max_new_tokens} new tokens, steps 2..{a.steps}")
    print("| rollout tok/s | train tok/s | MFU (vs bf16 peak) | s/step |\n|---|---|---|---|")
    train_rate = train_tok / train_s
    mfu = f"{6 * params * train_rate / peak:.1%}" if peak else "n/a"
    step_s = sum(r["time/step"] for r in rows) / len(rows)
    print(f"| {roll_tok / roll_s:,.0f} | {train_rate:,.0f} | {mfu} | {step_s:.2f} |")


if __name__ == "__main__":
    main()
