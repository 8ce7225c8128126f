"""memplan: parameter counts against the real model and transformers, the activation count against
what autograd saves, the plan's arithmetic on a small case computed here by hand, and its advice."""

import dataclasses
import os
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import config as C
from run import hfdir
from layers import lora
from run import memplan as P
from run import planreport
import model as M

ROOT = Path(__file__).resolve().parent.parent

# distinct sizes, so that no two terms of a count can stand in for each other
SMALL = dict(model_type="qwen3", vocab_size=300, hidden_size=96, intermediate_size=160, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True)
FAMILIES = [SMALL, {**SMALL, "tie_word_embeddings": False},
            {**SMALL, "model_type": "qwen2", "attention_bias": True, "head_dim": 24},
            {**SMALL, "model_type": "llama", "mlp_bias": True, "attention_bias": True, "tie_word_embeddings": False},
            {**SMALL, "model_type": "llama", "head_dim": 24}]


def numel(module: torch.nn.Module, trainable: bool = False) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable)  # a tied weight once


@pytest.mark.parametrize("cfg", FAMILIES, ids=lambda c: f"{c['model_type']}-tied{c['tie_word_embeddings']}")
def test_params_match_the_model(cfg):
    args = M.ModelArgs.from_hf(cfg)
    with torch.device("meta"):
        model = M.Transformer(args)
    shape = P.Shape(args)
    assert shape.params() == numel(model)
    assert shape.block_params() == numel(model.model.layers[0])
    assert shape.largest_tensor() == max(p.numel() for p in model.parameters())


# public shapes (the model cards' config.json) and small ones, counted by transformers on the meta device
HF_SHAPES = [("Qwen3Config", dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                                  num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False)),
             ("Qwen3Config", dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                  num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)),
             ("LlamaConfig", dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                  num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True)),
             ("LlamaConfig", dict(vocab_size=1000, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, mlp_bias=True, attention_bias=True))]


@pytest.mark.parametrize("kind,shape", HF_SHAPES, ids=lambda x: x if isinstance(x, str) else str(x["hidden_size"]))
def test_params_match_transformers(kind, shape):
    transformers = pytest.importorskip("transformers")
    cfg = getattr(transformers, kind)(**shape)
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(cfg)
    assert P.Shape.from_config(cfg.to_dict()).params() == numel(theirs)


def test_adapter_params_match_lora_add():
    args = M.ModelArgs.from_hf(SMALL)
    for targets in (lora.TARGETS, ("q_proj", "down_proj")):
        with torch.device("meta"):
            model = M.Transformer(args)
        lora.add(model, lora.LoRASpec(5, 32.0, targets))
        assert P.Shape(args).adapter_params(5, targets) == numel(model, trainable=True)


def saved_per_layer(cfg: dict, tokens: int, document: int, autocast: bool) -> tuple[int, int]:
    """Bytes autograd keeps for the backward, a layer (3 layers less 1, so the rest cancels), and the
    bytes of the bf16 weight casts among them."""
    def saved(layers):
        torch.manual_seed(0)
        model = M.Transformer(M.ModelArgs.from_hf({**cfg, "num_hidden_layers": layers}))
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        seen, casts = {}, 0
        lin = {tuple(s) for i, o in P.Shape(model.args).linears().values() for s in ((o, i), (i, o))}

        def pack(t):
            nonlocal casts
            key = t.untyped_storage().data_ptr()
            if key not in seen and key not in params:
                seen[key] = t.untyped_storage().nbytes()
                casts += t.untyped_storage().nbytes() if t.dtype == torch.bfloat16 and tuple(t.shape) in lin else 0
            return t
        ids = torch.arange(tokens)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            model(ids % cfg["vocab_size"], ids % document, ids // document)
        return sum(seen.values()), casts
    (one, c1), (three, c3) = saved(1), saved(3)
    return (three - one) // 2, (c3 - c1) // 2


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_saved_elements_are_what_autograd_keeps(autocast):
    tokens, document = 256, 32
    got, casts = saved_per_layer(SMALL, tokens, document, autocast)
    full, half = P.saved_elements(P.Shape(M.ModelArgs.from_hf(SMALL)), autocast, document)
    assert got - casts == tokens * (4 * full + 2 * half)
    lin = sum(i * o for i, o in P.Shape(M.ModelArgs.from_hf(SMALL)).linears().values())
    assert casts == (2 * lin if autocast else 0)  # what activation_bytes counts as the weights' casts


def test_plan_arithmetic_by_hand():
    """Two trainer ranks, full fine-tuning, a colocated built-in engine, CPU: every term computed here."""
    shape = P.Shape(M.ModelArgs.from_hf(SMALL))
    with torch.device("meta"):
        model = M.Transformer(shape.args)
    n = numel(model)
    block, root = numel(model.model.layers[0]), numel(model.model.embed_tokens) + numel(model.model.norm)
    s = P.Setup(world=2, micro_batch_tokens=512, document_tokens=64)
    t = P.plan(shape, s).role("trainer rank")
    per_layer = int(P.CPU_FP32_CALIBRATION * 4 * (6 * 96 + 2 + 5 * 64 + 4 * 32 + 2 * 4 + 2 + 4 * 160 + 64))
    chunk = min(512, (1 << 25) // 300)
    assert t.parts == {"weights": 4 * n // 2, "gradients": 4 * n // 2, "AdamW state": 8 * n // 2,
                       "FSDP2 gathered": 4 * (root + 2 * block) + 4 * block, "engine copy": 4 * n,
                       "activations": 512 * (3 * per_layer + int(P.BACKWARD_LAYERS * per_layer)),
                       "LM head chunk": int(P.CPU_HEAD_TILES * chunk * 300 * 4), "baseline": P.CPU_BASELINE}
    assert t.startup == 4 * n // 2 + 4 * n + 4 * max(300 * 96, block) + P.CPU_BASELINE  # a block outweighs the embedding here
    blocks = P.plan(shape, dataclasses.replace(s, activation_checkpointing="blocks")).role("trainer rank")
    assert blocks.parts["activations"] == 512 * (3 * 4 * 96 + per_layer)  # on a CPU: no backward term (measured)
    cuda = P.token_bytes(shape, dataclasses.replace(s, device="cuda", activation_checkpointing="blocks"))
    assert P.activation_bytes(shape, dataclasses.replace(s, device="cuda"))["blocks"] == 512 * (3 * 4 * 96 + cuda[0] + cuda[1])
    host = P.plan(shape, s).role("host per node")
    assert host.total == 2 * t.total and host.startup == 2 * t.startup


def test_lora_and_ranks_divide_what_they_should():
    shape = P.Shape(M.ModelArgs.from_hf(SMALL))
    full1, full4 = (P.plan(shape, P.Setup(world=w)).role("trainer rank").parts for w in (1, 4))
    for k in ("weights", "gradients", "AdamW state"):
        assert abs(full4[k] - full1[k] / 4) < 1
    assert full1["FSDP2 gathered"] == 0 < full4["FSDP2 gathered"]
    assert full4["engine copy"] == full1["engine copy"]  # each rank's engine is whole
    adapters = shape.adapter_params(8, lora.TARGETS)
    r8 = P.plan(shape, P.Setup(lora_rank=8)).role("trainer rank").parts
    assert r8["gradients"] == 4 * adapters and r8["AdamW state"] == 8 * adapters
    assert r8["weights"] == 4 * shape.params() + 4 * adapters
    bf16 = P.plan(shape, P.Setup(lora_rank=8, base_dtype="bf16")).role("trainer rank").parts
    linears = shape.args.num_hidden_layers * sum(i * o for i, o in shape.linears().values())  # every target: all of them
    assert bf16["weights"] == 2 * linears + 4 * (shape.params() - linears) + 4 * adapters


def test_split_inference_moves_the_engine():
    shape = P.Shape(M.ModelArgs.from_hf(SMALL))
    p = P.plan(shape, P.Setup(world=2, inference_gpus=1, device="cuda", engine_dtype="bf16"))
    assert p.role("trainer rank").parts["engine copy"] == 0
    assert p.role("inference rank").parts["engine copy"] == 2 * shape.params()
    vllm = P.plan(shape, P.Setup(world=2, inference_gpus=1, device="cuda", engine="vllm", vllm_memory=0.5,
                                 device_bytes=8 * P.GIB))
    assert vllm.role("inference rank").parts["engine copy"] == 4 * P.GIB


def test_an_inference_rank_holds_its_engine_and_what_a_push_or_merge_needs():
    """One copy, the engine's, and the largest tensor a push receives in the wire's dtype (fp32 for
    fp8, which quantizes on the rank); under LoRA the adapters twice (kept and received), and the
    fp32 base only where the rank merges them (the built-in engine, vLLM with --lora-merged)."""
    shape = P.Shape(M.ModelArgs.from_hf(SMALL))
    n, big = shape.params(), shape.largest_tensor()
    for dtype, wire in (("bf16", 2), ("fp16", 2), ("fp32", 4), ("fp8", 4)):
        parts = P.plan(shape, P.Setup(world=2, inference_gpus=1, device="cuda", engine_dtype=dtype)).role("inference rank").parts
        assert set(parts) == {"engine copy", "push buffer", "baseline"} and parts["push buffer"] == wire * big, dtype
    adapters = 4 * shape.adapter_params(8, P.TARGETS)
    for engine, merged, base in (("torch", False, 4 * n), ("vllm", True, 4 * n), ("vllm", False, 0)):
        parts = P.plan(shape, P.Setup(world=2, inference_gpus=1, device="cuda", engine=engine, lora_rank=8,
                                      lora_merged=merged, device_bytes=8 * P.GIB)).role("inference rank").parts
        assert parts["adapters"] == parts["push buffer"] == adapters
        assert parts.get("LoRA base", 0) == base, (engine, merged)


QWEN3_8B = dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False)


def test_advice_names_the_largest_part_and_what_fits():
    shape = P.Shape.from_config(QWEN3_8B)
    h100 = P.DEVICES["H100-80GB"]
    s = P.Setup(world=8, device="cuda", micro_batch_tokens=16384, device_bytes=h100)
    line = planreport.advice(shape, s, h100)
    assert "\n" not in line and "activations" in line
    assert "--activation-checkpointing blocks" in line
    fitting = line.split("would fit: ")[1].split("; or ")
    for change in fitting:  # each change named does fit, alone
        family = [c for fam in planreport.alternatives(s) for c in fam if c[0] == change]
        assert planreport.fits(shape, family[0][1], h100)
    assert planreport.advice(shape, dataclasses.replace(s, activation_checkpointing="blocks"), h100) is None
    auto = P.plan(shape, dataclasses.replace(s, activation_checkpointing="auto"))
    assert auto.setup.activation_checkpointing == "blocks"  # 80% of the device is passed without it
    cpu = P.plan(P.Shape(M.ModelArgs.from_hf(SMALL)), P.Setup(activation_checkpointing="auto"))
    assert cpu.setup.activation_checkpointing == "off"


def test_table_has_every_role_and_component():
    p = P.plan(P.Shape.from_config(QWEN3_8B), P.Setup(world=6, inference_gpus=2, device="cuda", micro_batch_tokens=16384))
    text = planreport.table(p)
    assert "| component | trainer rank | inference rank | host per node |" in text
    for k in ("weights", "gradients", "AdamW state", "activations", "LM head chunk", "start-up peak", "* computed"):
        assert k in text


@pytest.mark.parametrize("kwargs,words", [
    (dict(world=0), "--plan-world must be >= 1"),
    (dict(base_dtype="bf16"), "--base-dtype bf16 is for LoRA"),
    (dict(activation_checkpointing="layers"), "--activation-checkpointing 'layers' is not one of auto, off, blocks")])
def test_bad_setups_are_one_line(kwargs, words):
    with pytest.raises(P.PlanError) as e:
        P.Setup(**kwargs)
    assert words in str(e.value) and "\n" not in str(e.value)


# ----------------------------------------------------------------------------- the plan at the start (run/planreport.py)

QWEN3_06B = dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, tie_word_embeddings=True)


@pytest.fixture
def config_only(tmp_path):
    """A model directory holding config.json alone: whatever reads it, no weight can have been loaded."""
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(QWEN3_06B))
    return d


def test_plan_prints_the_table_from_config_json_alone_and_exits_0(config_only, tmp_path):
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), "--plan", "--plan-world", "8", "--device", "cuda",
                        "--model", str(config_only), "--lora-rank", "16", "--micro-batch-tokens", "16384",
                        "--out-dir", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "8 trainer rank(s) on cuda, LoRA r16" in r.stdout and "| **total** |" in r.stdout
    assert "H100-80GB (79.65 GiB): fits" in r.stdout  # a laptop sizes the GPU job
    assert not out.exists()


def settle(model_dir, *flags, device="cuda", size=80 * P.GIB) -> C.Config:
    """planreport.fit_memory on a device of `size` bytes (a fake one: the logic runs on the CPU)."""
    cfg = C.parse(["--model", str(model_dir), "--micro-batch-tokens", "16384", *flags])
    return planreport.fit_memory(dataclasses.replace(cfg, device=device, engine="torch"), size)


def test_auto_checkpointing_is_off_on_a_cpu_and_follows_the_plan_on_cuda(config_only):
    assert settle(config_only, device="cpu").activation_checkpointing == "off"
    off = P.trainer_role(P.Shape.from_config(QWEN3_06B), P.Setup(device="cuda", micro_batch_tokens=16384)).total
    over, under = int(off / 0.8) - 1, int(off / 0.8) + 1  # the plan without it just over and just under 80%
    assert settle(config_only, size=under).activation_checkpointing == "off"
    assert settle(config_only, size=over).activation_checkpointing == "blocks"
    assert settle(config_only, "--activation-checkpointing", "off", size=over).activation_checkpointing == "off"


def test_a_plan_over_the_device_stops_with_the_advice_unless_plan_check_is_off(config_only):
    with pytest.raises(C.ConfigError) as e:  # over the device even with blocks: planreport.advice's one line
        settle(config_only, size=12 * P.GIB)
    why = str(e.value)
    assert why.startswith("the memory plan needs ") and "; or --lora-rank 16; or --micro-batch-tokens 4096 (" in why and "\n" not in why
    assert why.endswith("(--plan prints the plan; --plan-check off starts anyway)")
    assert settle(config_only, "--plan-check", "off", size=12 * P.GIB).activation_checkpointing == "blocks"


@pytest.mark.parametrize("flags", [["--lora-rank", "65"], ["--lora-rank", "200", "--lora-targets", "down_proj"],
                                   ["--lora-rank", "4", "--lora-targets", "q_proj", "qkv_proj"]])
def test_a_plan_refuses_lora_flags_the_run_refuses_with_the_runs_line(flags):
    """--plan once printed a table (exit 0) for a rank above a layer's width, and counted a stray
    target as no adapter; a CUDA start would have named memory, not the flag."""
    tiny = ROOT / "checkpoints" / "reverse-tiny"
    cfg = C.parse(["--model", str(tiny), "--plan", *flags]).resolve(False)
    model = hfdir.load(tiny)
    with pytest.raises(ValueError) as run:
        lora.add(model, lora.LoRASpec(cfg.lora_rank, cfg.lora_alpha, tuple(cfg.lora_targets)))
    with pytest.raises(C.ConfigError) as plan:
        planreport.plan_text(cfg)
    assert str(plan.value) == f"--plan: {run.value}"
    with pytest.raises(C.ConfigError) as cuda:
        settle(tiny, *flags, size=80 * P.GIB)
    assert str(cuda.value) == f"the memory plan: {run.value}"


def test_a_plan_of_a_resume_plans_what_the_resume_would_run_or_says_why_not(tmp_path):
    """--plan --resume once planned full fine-tuning of a LoRA run resumed without --lora-rank (which the
    resume refuses), and the default model for a directory holding no run, exit 0 both."""
    out = tmp_path / "run"
    with pytest.raises(C.ConfigError, match=f"--plan --resume: {out} holds no floe run"):
        planreport.plan_text(C.parse(["--plan", "--resume", "--out-dir", str(out)]).resolve(False))
    out.mkdir()
    (out / "config.json").write_text(C.parse(["--lora-rank", "4", "--out-dir", str(out)]).resolve(False).to_json())
    with pytest.raises(C.ConfigError, match=f"--resume: --lora-rank is 0 but the run in {out} used 4"):
        planreport.plan_text(C.parse(["--plan", "--resume", "--out-dir", str(out)]).resolve(False))
    text = planreport.plan_text(C.parse(["--plan", "--resume", "--lora-rank", "4", "--plan-world", "8", "--out-dir", str(out)]).resolve(False))
    assert "8 trainer rank(s) on cpu, LoRA r4" in text


def test_a_fifo_named_config_json_is_refused_by_the_plan_not_read(tmp_path):
    """--plan read --model's config.json without asking what it was: a FIFO blocked it forever (and a
    CUDA start, which plans before the other checks)."""
    d = tmp_path / "model"
    d.mkdir()
    os.mkfifo(d / "config.json")
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), "--plan", "--model", str(d)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip() == f"floe: error: --plan: {d / 'config.json'}: not a regular file", r.stderr


def test_a_laptop_plans_a_split_inference_job(monkeypatch):
    """--plan --inference-gpus k was refused outside torchrun ("needs torchrun with more processes"), so a
    split job could not be sized before it was launched; the run itself still needs those processes."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    flags = ["--plan-world", "6", "--inference-gpus", "2", "--device", "cuda", "--engine", "torch"]
    text = planreport.plan_text(C.parse(["--plan", *flags]).resolve(True))
    assert "6 trainer rank(s) + 2 inference on cuda" in text and "inference rank" in text.splitlines()[2]
    with pytest.raises(C.ConfigError, match="--inference-gpus 2 needs torchrun with more processes than that"):
        C.parse(flags[2:]).resolve(True)
