#!/usr/bin/env bash
# The GPU checks, in two parts, each under one 600 s device command and each printing its figures as
# it goes (a cut run still reports what it reached). Run from the repo root:
#
#   bash bench/gpu.sh 1     # first, under 5 minutes: the gpu-marked tests (CUDA against the CPU
#                           # reference, compiled against eager, the push-then-draw check with the decode step a CUDA graph
#                           # and no graph skipped: engines/kvcache.py `Slots`), the default
#                           # job compiled (graphs after warm-up must be 0) against eager, the fp8/fp16 lab
#   bash bench/gpu.sh 2     # then: the benchmarks (support, head, engine, e2e eager and compiled on a
#                           # Qwen3-0.6B shape, memory), episodes, LoRA on vLLM, LoRA's memory table
#   bash bench/gpu.sh       # both, one after the other; results in $OUT (or /tmp/floe-gpu)
#
# The device image has torch, transformers, safetensors and tokenizers but not tyro: carry
# pure-Python wheels in .whl/ (see .ci/gpu-wheels) and they are installed here first. Its package
# list (2026-11: torch 2.11, triton 3.6, peft, matplotlib) holds no vLLM, whose CUDA wheel is far over
# the device tool's 64 MiB carry: there every vLLM block below skips or falls back to the built-in engine.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/floe-gpu}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -c "import torch; print('torch', torch.__version__, '|', torch.cuda.get_device_name(0))" | tee "$OUT/env.txt"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/env.txt"
PART=${1:-all}
case "$PART" in 1|2|all) ;; *) echo "bench/gpu.sh: part must be 1, 2 or left out (both), not '$PART'"; exit 2;; esac
steps() {  # the median time/step of steps 3 on, and the graphs each step built (runlog.Graphs)
  python3 -c 'import json, statistics, sys
rows = [r for r in map(json.loads, open(sys.argv[1])) if "time/step" in r]
print(sys.argv[2], "median time/step (steps 3 on):", round(statistics.median(r["time/step"] for r in rows[2:]), 4), "s",
      "| compile/new_graphs by step:", [r.get("compile/new_graphs") for r in rows])' "$1" "$2" 2>&1
}

if [ "$PART" != 2 ]; then
echo "== part 1"

echo "== gpu tests (kernels, flex attention, bf16/fp16 training against CPU/eager references; vLLM fp8 where it imports)"
timeout 130 python3 -m pytest -q -m gpu tests/ --ignore=tests/test_lora_vllm.py 2>&1 | tee "$OUT/tests.txt"  # LoRA's: below

echo "== end to end: the default job on the GPU, 10 steps, compiled (the CUDA default) then eager"
# the trainer forward and the engine's decode step compile on a cold cache (train.py's own line
# says "compiling, ~1 min"), so 30 s would stop it before its first step
timeout 90 python3 train.py --device cuda --loss icepop --icepop-beta 2.0 --steps 10 --eval-every 5 \
  --out-dir "$OUT/run" 2>&1 | grep -v '^  "' | tee "$OUT/run.txt"
timeout 30 python3 train.py --device cuda --loss icepop --icepop-beta 2.0 --steps 10 --eval-every 5 --compile off \
  --out-dir "$OUT/run-eager" 2>&1 | grep -v '^  "' | tee "$OUT/run-eager.txt"
# compile/new_graphs: 0 after warm-up (steps 1-2), or a warning line above names the guard
{ steps "$OUT/run/metrics.jsonl" compiled; steps "$OUT/run-eager/metrics.jsonl" eager; } | tee -a "$OUT/run.txt"
echo "== the mismatch lab on the GPU: fp8 rollouts (vLLM's fp8 where the image has vLLM) and an fp16 trainer, 10 steps"
timeout 30 python3 train.py --device cuda --loss icepop --icepop-beta 2.0 --steps 10 --eval-every 5 --engine-dtype fp8 \
  --train-dtype fp16 --compile off --out-dir "$OUT/run-fp8" 2>&1 | grep -v '^  "' | tee "$OUT/run-fp8.txt"
fi

if [ "$PART" != 1 ]; then
SECONDS=0  # part 2 counts its own time
echo "== part 2"
echo "== bench/support.py"
timeout 30 python3 bench/support.py 2>&1 | tee "$OUT/support.txt"

echo "== bench/head.py (the fused head: Triton kernels vs baselines; its tests ran with -m gpu above)"
timeout 65 python3 bench/head.py 2>&1 | tee "$OUT/head.txt"

echo "== bench/engine.py (rollout tok/s: built-in engine, and vLLM where the image has it)"
timeout 30 python3 bench/engine.py 2>&1 | grep -E '^[#|]' | tee "$OUT/engine.txt"

echo "== bench/e2e.py (random Qwen3-0.6B shape: rollout and train tok/s, MFU), trainer in bf16 then fp32"
# eager first (a minute each), then compiled with two minutes for its compile of 28 layers
timeout 60 python3 bench/e2e.py --compile off --train-dtype bf16 2>&1 | grep -v '^  "' | tee "$OUT/e2e.txt"
timeout 60 python3 bench/e2e.py --compile off --train-dtype fp32 2>&1 | grep -v '^  "' | tee -a "$OUT/e2e.txt"
echo "== bench/e2e.py compiled (the same Qwen3-0.6B shape, bf16): the compiled step against the eager one above"
timeout 120 python3 bench/e2e.py --compile on --train-dtype bf16 2>&1 | grep -v '^  "' | tee -a "$OUT/e2e.txt"

echo "== bench/memory.py cuda: the memory plan against torch.cuda.max_memory_allocated (Qwen3-0.6B shape, 4k/16k tokens, checkpointing off/blocks)"
timeout 90 python3 bench/memory.py cuda 2>&1 | tee "$OUT/memory.txt"

# --engine auto: vLLM where the image has it (each turn a token prompt, asleep only after a step's last turn)
echo "== multi-turn episodes on the GPU (vLLM where the image has it, else the built-in engine): the guess-letter game, 5 steps"
timeout 45 python3 train.py --device cuda --task jsonl:examples/guess.jsonl --env guess-letter --model checkpoints/guess-tiny \
  --max-new-tokens 4 --prompts-per-step 16 --group-size 8 --steps 5 --eval-every 5 --eval-prompts 16 \
  --compile off --out-dir "$OUT/run-episodes" 2>&1 | grep -v '^  "' | tee "$OUT/run-episodes.txt"
echo "== partial rollouts on the GPU (vLLM where the image has it): --max-staleness 2, each push at decode step 4, 10 steps"
timeout 40 python3 train.py --device cuda --max-staleness 2 --push-at-decode-step 4 --steps 10 --eval-every 5 --compile off \
  --out-dir "$OUT/run-partial" 2>&1 | grep -v '^  "' | tee "$OUT/run-partial.txt"
python3 -c "import json, sys; rows = [json.loads(l) for l in open(sys.argv[1])][1:]
print('spanning_push', [r.get('async/spanning_push') for r in rows], 'staleness/max', max(r.get('staleness/max', 0) for r in rows))" \
  "$OUT/run-partial/metrics.jsonl" 2>&1 | tee -a "$OUT/run-partial.txt"
echo "== LoRA on the GPU: vLLM's adapter path where the image has vLLM (its GPU test, then 10 steps), else 10 steps on the built-in engine"
left=$((540 - SECONDS))  # what the steps above left of part 2's 9 minutes (SECONDS: since part 2 began)
LORA="--device cuda --compile off --lora-rank 8 --lr 3e-3 --loss icepop --icepop-beta 2.0 --steps 10 --eval-every 5 --out-dir $OUT/run-lora"
if [ "$left" -lt 30 ]; then
  echo "(${left}s left of part 2's 9 minutes: skipped)" | tee "$OUT/lora.txt"
elif ! python3 -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"; then
  timeout "$((left < 60 ? left : 60))" python3 train.py --engine torch $LORA 2>&1 | grep -v '^  "' | tee "$OUT/lora.txt"
else  # its own pytest process: one vLLM per process
  timeout "$left" bash -c "python3 -m pytest -q -s -m gpu tests/test_lora_vllm.py && python3 train.py --engine vllm $LORA" \
    2>&1 | grep -v '^  "' | tee "$OUT/lora.txt"
fi
echo "== bench/lora.py memory on the GPU (Qwen3-0.6B-shaped: full, LoRA r8, r64), in what is left"
left=$((540 - SECONDS))
if [ "$left" -lt 60 ]; then
  echo "(${left}s left of part 2's 9 minutes: skipped)" | tee "$OUT/lora-memory.txt"
else
  timeout "$left" python3 bench/lora.py memory --device cuda --out /tmp/floe-lora-memory 2>&1 | tee "$OUT/lora-memory.txt"
fi
fi
# worst case, every timeout reached. Part 1: 130 + 90 + 30 + 30 = 280 s of commands. Part 2: 30 + 65 + 30
# + 60 + 60 + 120 + 90 + 45 + 40 = 540 s, and LoRA and its memory table take only what is left of 540 s; typical
# runs finish well inside them. Run each part as its own device command (timeout_s 600). Only the default job
# and the compiled e2e compile (the gpu tests compile the forward, flex attention and the engine step): the
# fp8/fp16, episode and LoRA runs run eager, where each would otherwise compile a graph of its own.
