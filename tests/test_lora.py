"""LoRA (layers/lora.py) against references: peft on the same base (logits, and floe's saved adapter loaded
by peft), transformers on the merged directory, autograd on the dense W + (alpha / r) B A, the
engine's merged copy; the trainer's step moves the adapters alone."""

import copy
import random

import pytest
import torch
from torch.func import functional_call

import config as C
from tasks.textcodec import TextCodec
from layers import lora
import model as M
from run import hfdir
from tasks import task as T
import rollout
import train
from engines.kvcache import KVCache
from engines.torch_engine import TorchEngine
from test_model import _family_checkpoint

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
SPEC = lora.LoRASpec(4, 8.0, tuple(sorted(lora.TARGETS)))
FAMILIES = [("qwen3", True), ("qwen2", False), ("llama", False)]


def _adapted(model: M.Transformer, spec=SPEC, seed=0) -> M.Transformer:
    """Adapters on `model` with non-zero B (PEFT's init has B = 0, which would compare base to base)."""
    torch.manual_seed(seed)
    lora.add(model, spec)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for m in lora.adapted(model).values():
            m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g) * 0.1)
    return model


def _logits(ours: M.Transformer, ids: torch.Tensor) -> torch.Tensor:
    T = ids.shape[1]
    return ours(ids[0], torch.arange(T), torch.zeros(T, dtype=torch.long)) @ ours.head_weight.T


def _peft(model_dir, spec=SPEC):
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cfg = peft.LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=list(spec.targets), lora_dropout=0.0)
    return peft.get_peft_model(hf, cfg).eval()


IDS = torch.randint(0, 48, (1, 29), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("family,tie", FAMILIES)
def test_logits_match_peft_on_the_same_base(tmp_path, family, tie):
    _family_checkpoint(tmp_path, family, tie)
    ours = _adapted(hfdir.load(tmp_path))
    ref = _peft(tmp_path)
    loaded = peft.set_peft_model_state_dict(ref, lora.adapter_state(ours))  # floe's names are peft's
    assert not loaded.unexpected_keys and not [k for k in loaded.missing_keys if "lora_" in k]
    with torch.no_grad():
        got, want = _logits(ours, IDS), ref(IDS).logits[0]
        base = ref.get_base_model()
        with ref.disable_adapter():
            plain = base(IDS).logits[0]
    assert (want - plain).abs().max() > 0.05  # the adapter moves the logits: the comparison can fail
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family,tie", FAMILIES)
def test_a_saved_adapter_loads_in_peft_and_the_merged_directory_in_transformers(tmp_path, family, tie):
    _family_checkpoint(tmp_path / "base", family, tie)
    ours = _adapted(hfdir.load(tmp_path / "base"))
    lora.write_adapter(tmp_path / "adapter", lora.adapter_state(ours), ours.lora, str(tmp_path / "base"))
    hfdir.save(ours, tmp_path / "merged", tmp_path / "base",
           state=lora.merged(lora.base_state(ours), lora.adapter_state(ours), ours.lora))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32).eval()
    via_peft = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    assert not (tmp_path / "merged" / lora.CONFIG).exists()  # a plain HF directory: nothing for peft to find
    with torch.no_grad():
        got = _logits(ours, IDS)
        torch.testing.assert_close(via_peft(IDS).logits[0], got, atol=1e-5, rtol=0)
        torch.testing.assert_close(merged(IDS).logits[0], got, atol=1e-5, rtol=0)
    spec, tensors, base = lora.read_adapter(tmp_path / "adapter")  # and back: what floe wrote, floe reads
    assert spec == ours.lora and base == str(tmp_path / "base")
    assert all(torch.equal(tensors[k], v) for k, v in lora.adapter_state(ours).items())


def _packed(T=40):
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, 32, (T,), generator=g)
    docs = torch.repeat_interleave(torch.arange(3), torch.tensor([15, 13, T - 28]))
    positions = torch.cat([torch.arange(15), torch.arange(13), torch.arange(T - 28)])
    return tokens, positions, docs, torch.randn(T, 32, generator=g)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
def test_adapter_gradients_equal_autograd_on_the_dense_weight(dtype, tol):
    """d loss / d A and d B through floe's packed forward (LoRALinear) against autograd through the plain
    model with each adapted weight replaced by the dense W + (alpha / r) B A: within `tol` of the
    gradient's largest entry (fp32: the two orders of summation round apart; fp64: the same maths)."""
    base = M.Transformer(M.ModelArgs(vocab_size=32, **M.TINY))
    M.init_weights(base, std=0.1, seed=0)
    ours = _adapted(copy.deepcopy(base), lora.LoRASpec(8, 16.0, ("q_proj", "v_proj", "down_proj", "gate_proj")))
    base.to(dtype), ours.to(dtype)
    tokens, positions, docs, probe = _packed()
    (ours(tokens, positions, docs) @ ours.head_weight.T * probe.to(dtype)).sum().backward()
    layers = lora.adapted(ours)
    leaves = {n: (m.lora_A.weight.detach().clone().requires_grad_(), m.lora_B.weight.detach().clone().requires_grad_())
              for n, m in layers.items()}
    dense = {f"{n}.weight": layers[n].weight + ours.lora.scale * (b @ a) for n, (a, b) in leaves.items()}
    hidden = functional_call(base, dense, (tokens, positions, docs))
    (hidden @ base.head_weight.T * probe.to(dtype)).sum().backward()
    assert len(leaves) == 4 * M.TINY["num_hidden_layers"]
    for n, (a, b) in leaves.items():
        for got, want in ((layers[n].lora_A.weight.grad, a.grad), (layers[n].lora_B.weight.grad, b.grad)):
            assert want.abs().max() > 1.0  # a live gradient
            assert (got - want).abs().max() <= tol * want.abs().max(), n
    assert all(p.grad is None for n, p in ours.named_parameters() if not lora.is_adapter_key(n))  # the base is frozen


def _tiny_adapted():
    m = M.Transformer(M.ModelArgs(vocab_size=32, **M.TINY))
    M.init_weights(m, std=0.1, seed=0)
    return _adapted(m, lora.LoRASpec(8, 32.0, tuple(sorted(lora.TARGETS))))


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp8"])
def test_the_engine_holds_the_merged_weights_after_every_push(dtype):
    ours = _tiny_adapted()
    engine = TorchEngine(ours, dtype, [0])

    def reference():  # a new engine over a plain model of the merged weights: what every push must equal
        plain = M.Transformer(ours.args)
        plain.load_state_dict(lora.merged(lora.base_state(ours), lora.adapter_state(ours), ours.lora))
        return TorchEngine(plain, dtype, [0]).model.state_dict()

    for push in range(2):
        got = engine.model.state_dict()
        want = reference()
        assert got.keys() == want.keys() and not any("lora" in k for k in got)
        for k in want:
            assert torch.equal(got[k], want[k]), k
        with torch.no_grad():  # a step's worth of change in the adapters, then the next push
            for m in lora.adapted(ours).values():
                m.lora_A.weight.add_(0.01)
                m.lora_B.weight.mul_(1.5)
        engine.load_weights(ours, version=push + 1)
    if dtype == "fp32":  # the engine's hidden states are the trainer's, to fp32 rounding (merged: one matmul, not two)
        tokens, positions, docs, _ = _packed()
        with torch.no_grad():
            cache = KVCache(ours.args, 1, 15, torch.float32, "cpu")
            h = engine.model.forward_cached(tokens[None, :15], positions[None, :15], cache)[0]
            ref = ours(tokens[:15], positions[:15], docs[:15] * 0)
            assert (h - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_a_step_moves_the_adapters_alone_and_adam_holds_only_theirs():
    codec = TextCodec.tiny()
    model = _tiny_adapted()
    cfg = C.Config(loss="icepop", prompts_per_step=4, group_size=3, max_new_tokens=10, lr=1e-2, lora_rank=8).resolve(False)
    samples, _ = rollout.rollout_phase(cfg, T.ReverseText(codec, eval_size=4), TorchEngine(model, "bf16", codec.stop_ids),
                                     random.Random(0), 0, 512)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=cfg.lr)
    mbs, denom, _ = train.prepare(cfg, samples, 32, "cpu")
    train.backward_pass(cfg, model, model, mbs, denom, step=0)
    m = train.optimizer_step(cfg, model, opt, step=1)
    assert m["grad_norm"][0] > 0
    after = model.state_dict()
    moved = {k for k in after if not torch.equal(after[k], before[k])}
    assert moved == {k for k in after if lora.is_adapter_key(k)}  # every adapter, nothing else
    assert {id(p) for p in opt.state} == {id(p) for p in trained} and len(trained) == 2 * 7 * M.TINY["num_hidden_layers"]


def test_the_compiled_packed_forward_and_its_adapter_gradients_equal_eager():
    torch._dynamo.reset()
    ours = M.Transformer(M.ModelArgs(vocab_size=32, **{**M.TINY, "num_hidden_layers": 1}))  # one block: compiles faster
    M.init_weights(ours, std=0.1, seed=0)
    _adapted(ours, lora.LoRASpec(8, 32.0, tuple(sorted(lora.TARGETS))))
    ours.attention = "dense"  # the CPU's compiled path
    tokens, positions, docs, probe = _packed(64)
    runs = []
    for fwd in (ours, torch.compile(ours)):
        hidden = fwd(tokens, positions, docs)
        (hidden @ ours.head_weight.T * probe).sum().backward()
        runs.append((hidden.detach(), {n: p.grad.clone() for n, p in ours.named_parameters() if p.requires_grad}))
        ours.zero_grad(set_to_none=True)
    (h0, g0), (h1, g1) = runs
    torch.testing.assert_close(h1, h0, atol=1e-5, rtol=1e-5)
    assert g0.keys() == g1.keys() and len(g0) == 2 * 7
    for n in g0:  # within fp32 rounding of the largest entry (the compiled kernels sum in their own order)
        assert g0[n].abs().max() > 1.0 and (g1[n] - g0[n]).abs().max() <= 1e-5 * g0[n].abs().max(), n


def test_bench_linears_arm_trains_exactly_the_layers_lora_adapts():
    """bench/lora.py's diagnosis arm (full fine-tuning with what LoRA leaves frozen frozen) must train
    the weights of the adapted layers and nothing else, and give start.shard back afterwards."""
    from run import start
    from conftest import ROOT, bench_module

    bench_lora = bench_module("lora")
    real = start.shard
    model = hfdir.load(ROOT / "checkpoints" / "reverse-tiny")
    with bench_lora.linears_only():
        start.shard(model)
    assert start.shard is real
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    adapters = hfdir.load(ROOT / "checkpoints" / "reverse-tiny")
    lora.add(adapters, SPEC)
    assert trained == {f"{name}.weight" for name in lora.adapted(adapters)} and len(trained) == 4 * 7


def test_bench_bf16_start_holds_the_base_rounded_once(tmp_path):
    """bench/lora.py's --bf16-start: every weight of the start equals reverse-tiny's rounded to bf16,
    so --base-dtype bf16 stores it without loss and the two arms hold the same base."""
    from conftest import ROOT, bench_module

    src = hfdir.load(ROOT / "checkpoints" / "reverse-tiny").state_dict()
    copy_dir = bench_module("lora").bf16_copy(tmp_path / "start")
    got = hfdir.load(copy_dir).state_dict()
    assert got.keys() == src.keys()
    for k, v in src.items():
        assert torch.equal(got[k], v.to(torch.bfloat16).float()), k
        assert torch.equal(got[k], got[k].to(torch.bfloat16).float()), k
    assert any(not torch.equal(got[k], v) for k, v in src.items())  # the rounding did something


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_lora_compiled_forward_gradients_and_push_equal_the_cpu():
    """On a GPU (bench/gpu.sh): the adapted model compiled on CUDA (flex attention) gives the CPU eager
    hidden states and adapter gradients, and a built-in engine push on CUDA holds the merged weights."""
    cpu = _tiny_adapted()
    gpu = copy.deepcopy(cpu).cuda()
    tokens, positions, docs, probe = _packed()
    runs = []
    for m, fwd, dev in ((cpu, cpu, "cpu"), (gpu, torch.compile(gpu), "cuda")):
        hidden = fwd(*(x.to(dev) for x in (tokens, positions, docs)))
        (hidden @ m.head_weight.T * probe.to(dev)).sum().backward()
        runs.append((hidden.detach().cpu(), {n: p.grad.cpu() for n, p in m.named_parameters() if p.requires_grad}))
    (h0, g0), (h1, g1) = runs
    torch.testing.assert_close(h1, h0, atol=1e-4, rtol=1e-4)
    assert g0.keys() == g1.keys() and len(g0) == 2 * 7 * M.TINY["num_hidden_layers"]
    for n in g0:
        assert (g1[n] - g0[n]).abs().max() <= 1e-4 * g0[n].abs().max(), n
    engine = TorchEngine(gpu, "fp32", [0])
    engine.load_weights(gpu, version=1)
    want = lora.merged(lora.base_state(cpu), lora.adapter_state(cpu), cpu.lora)
    got = engine.model.state_dict()
    for k, w in want.items():
        torch.testing.assert_close(got[k].cpu(), w, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
def test_an_adapter_tensor_stored_as_integers_is_refused_not_cast(dtype):
    """An int64 lora_B of the right shape was copied into the adapter as floats: --adapter and a resume
    trained from other weights than the file's, silently."""
    torch.manual_seed(0)
    model = M.Transformer(M.ModelArgs(32, **M.TINY))
    lora.add(model, lora.LoRASpec(4, 32.0))
    tensors = lora.adapter_state(model)
    key = sorted(k for k in tensors if "lora_B" in k)[0]
    tensors[key] = (tensors[key] * 1000).to(dtype)
    with pytest.raises(ValueError) as e:
        lora.check_adapter(model, tensors, "adapter_model.safetensors")
    assert str(e.value) == (f"adapter_model.safetensors: {key} is stored as {str(dtype)[6:]}, not as a weight "
                            "(a floating-point tensor)")
