"""What lets a big model fit, each against a reference computed without it: blocks recomputed in the
backward (--activation-checkpointing blocks), LoRA's bf16 frozen base (--base-dtype bf16), and the
sharded load (hfdir.load on each rank's rows)."""

import json
import os
import platform
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import config as C
import data as D
from run import hfdir
from layers import lora
from engines.kvcache import KVCache
import model as M
from tasks import task as T
import train
from test_distributed import torchrun
from tasks.textcodec import TextCodec

ROOT = Path(__file__).resolve().parent.parent
TINY_DIR = ROOT / "checkpoints" / "reverse-tiny"


def batch(n: int = 8, seed: int = 0) -> list[D.Sample]:
    """Samples of varied lengths with advantages, packed into several documents a micro-batch."""
    rng, codec = random.Random(seed), TextCodec.tiny()
    out = []
    for p in T.ReverseText(codec, eval_size=4).sample(n, rng):
        comp = [rng.randrange(3, 32) for _ in range(rng.randint(2, 9))]
        logq = [-rng.random() for _ in comp]
        out.append(D.Sample(p, comp, logq, [0] * len(comp), "length", advantage=rng.uniform(-1, 1)))
    return out


def tiny(seed: int = 0, rank: int = 0) -> M.Transformer:
    model = M.Transformer(M.ModelArgs(vocab_size=32, **M.TINY))
    M.init_weights(model, std=0.1, seed=seed)
    if rank:
        torch.manual_seed(seed)
        lora.add(model, lora.LoRASpec(rank, 8.0))
        with torch.no_grad():  # B non-zero, so every adapter has a gradient
            for layer in lora.adapted(model).values():
                layer.lora_B.weight.normal_(0, 0.1)
    return model


def grads(cfg: C.Config, model: M.Transformer, fwd=None) -> dict[str, torch.Tensor]:
    """One rl step's gradients (train.prepare and train.backward_pass), then zeroed."""
    mbs, denom, _ = train.prepare(cfg, batch(), 32, "cpu")
    train.backward_pass(cfg, model, model if fwd is None else fwd, mbs, denom, step=0)
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("lora_rank,train_dtype", [(0, "fp32"), (4, "fp32"), (0, "bf16"), (4, "fp16")])
def test_recomputed_blocks_give_the_gradients_of_kept_ones(lora_rank, train_dtype):
    cfg = C.Config(micro_batch_tokens=128, lora_rank=lora_rank, train_dtype=train_dtype, bad_evidence="drop").resolve(False)
    model = tiny(rank=lora_rank)
    kept = grads(cfg, model)
    model.checkpointing = True
    saved = []  # what autograd keeps: a recomputed block keeps its input alone
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        recomputed = grads(cfg, model)
    assert kept.keys() == recomputed.keys() and len(kept) == (56 if lora_rank else 46)
    for name in kept:
        torch.testing.assert_close(recomputed[name], kept[name], rtol=0, atol=1e-6, msg=name)
    model.checkpointing = False
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(-t.numel()) or t, lambda t: t):
        grads(cfg, model)
    assert 0 < sum(n for n in saved if n > 0) < sum(-n for n in saved if n < 0) / 2


def test_recomputed_blocks_compose_with_torch_compile():
    """dynamo traces the checkpoint (aot_eager: the same graph as inductor's input, with no C++ build)."""
    cfg = C.Config(micro_batch_tokens=128, compile="on", bad_evidence="drop").resolve(False)
    model = tiny()
    kept = grads(cfg, model)
    model.checkpointing = True
    torch._dynamo.reset()
    recomputed = grads(cfg, model, torch.compile(model, backend="aot_eager"))
    for name in kept:
        torch.testing.assert_close(recomputed[name], kept[name], rtol=1e-5, atol=1e-6, msg=name)


HEAP = """
import sys
sys.path[:0] = [{root!r}]
import os
import torch
from run import start
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
mapped = sys.argv[1] == "1" and start.map_large_buffers()
big = torch.ones(24 << 18); del big  # a 24 MiB buffer freed: glibc's dynamic mmap threshold rises past 8 MiB
before = rss()
a = torch.ones(8 << 18)  # 8 MiB, written
pin = torch.ones(256)  # a small buffer above it in the heap
del a
print(mapped, rss() - before)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc")
def test_recomputed_blocks_free_their_buffers_to_the_system_on_a_cpu(tmp_path):
    """start.build's map_large_buffers for blocks on a CPU: an activation-sized buffer freed under a live
    one leaves the process; under glibc's defaults the heap keeps it (what made checkpointing save
    little on a CPU). The defaults' arm shows the test tells the two apart."""
    script = tmp_path / "heap.py"
    script.write_text(HEAP.format(root=str(ROOT)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    kept = {}
    for arm in ("0", "1"):
        r = subprocess.run([sys.executable, str(script), arm], capture_output=True, text=True, timeout=120, env=env)
        mapped, grew = r.stdout.split()
        kept[arm] = (mapped, int(grew))
    assert kept["0"][1] > 6 * 2**20  # the heap kept the 8 MiB
    assert kept["1"][0] == "True" and kept["1"][1] < 2**20  # unmapped when freed


def test_build_maps_large_buffers_for_blocks_on_a_cpu_only(monkeypatch, tmp_path):
    from run import start
    calls = []
    monkeypatch.setattr(start, "map_large_buffers", lambda: calls.append(1))
    codec = TextCodec.load(TINY_DIR)
    for ac, want in (("off", 0), ("blocks", 1)):
        cfg = C.Config(activation_checkpointing=ac, out_dir=str(tmp_path / ac)).resolve(False)
        calls.clear()
        model = hfdir.load(TINY_DIR)
        start.build(cfg, TINY_DIR, model, codec)
        assert len(calls) == want and model.checkpointing == (ac == "blocks")


def test_decoding_never_recomputes():
    model = tiny()
    model.checkpointing = True
    cache = KVCache(model.args, 2, 16, torch.float32, "cpu")
    tokens, positions = torch.randint(0, 32, (2, 5)), torch.arange(5).repeat(2, 1)
    calls = []
    handle = torch.utils.checkpoint.checkpoint
    try:
        M.checkpoint = lambda *a, **k: calls.append(1) or handle(*a, **k)
        model.forward_cached(tokens, positions, cache)
        with torch.no_grad():
            model(tokens[0], positions[0], torch.zeros(5, dtype=torch.long))
        assert not calls
        model(tokens[0], positions[0], torch.zeros(5, dtype=torch.long))
        assert len(calls) == model.args.num_hidden_layers
    finally:
        M.checkpoint = handle


def rounded_base(model: M.Transformer) -> None:
    """The adapted layers' frozen weights rounded to bf16 in place (kept fp32): the reference a bf16 base equals."""
    with torch.no_grad():
        for layer in lora.adapted(model).values():
            layer.weight.copy_(layer.weight.bfloat16().float())


@pytest.mark.parametrize("train_dtype", ["fp32", "bf16"])
def test_a_bf16_base_trains_as_its_values_in_fp32(train_dtype):
    cfg = C.Config(micro_batch_tokens=128, lora_rank=4, train_dtype=train_dtype, bad_evidence="drop").resolve(False)
    ref = tiny(rank=4)
    rounded_base(ref)
    low = M.Transformer(ref.args)
    lora.add(low, lora.LoRASpec(4, 8.0), "bf16")
    low.load_state_dict(ref.state_dict())
    layers = lora.adapted(low).values()
    assert all(m.weight.dtype == torch.bfloat16 and m.lora_A.weight.dtype == torch.float32 for m in layers)
    want = grads(cfg, ref)
    weights = {p.untyped_storage().data_ptr() for p in low.parameters()}
    base = [m.weight for m in layers]
    kept = []  # what autograd keeps beyond the parameters themselves
    hook = lambda t: kept.append(t) if t.untyped_storage().data_ptr() not in weights else None  # noqa: E731
    with torch.autograd.graph.saved_tensors_hooks(lambda t: hook(t) or t, lambda t: t):
        got = grads(cfg, low)
    upcast = [t for t in kept for w in base if t.shape == w.shape and torch.equal(t.float(), w.float())]
    assert not upcast  # FrozenLinear keeps the bf16 weight itself, not an upcast copy
    assert got.keys() == want.keys() and all(lora.is_adapter_key(k) for k in got)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-6, msg=name)


def test_a_merge_into_a_bf16_base_is_fp32():
    w, a, b = torch.randn(6, 5).bfloat16(), torch.randn(3, 5), torch.randn(6, 3) * 1e-3
    out = lora.merge(w, a, b, 2.0)
    assert out.dtype == torch.float32
    assert torch.equal(out, w.float() + 2.0 * b @ a) or torch.allclose(out, w.float() + 2.0 * b @ a, rtol=0, atol=1e-7)
    assert not torch.equal(out, out.bfloat16().float())  # BA's small update would not survive a bf16 rounding


# ----------------------------------------------------------------------------- the sharded load

def write_sharded(src: Path, out: Path, dtype=torch.float32) -> Path:
    """`src`'s weights as HF's sharded layout: two files, every other tensor, and the index naming them."""
    out.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    state = load_file(str(src / "model.safetensors"))
    names = sorted(state)
    files = {f"model-0000{i + 1}-of-00002.safetensors": names[i::2] for i in range(2)}
    for f, keys in files.items():
        save_file({k: state[k].to(dtype).contiguous() for k in keys}, str(out / f), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: f for f, keys in files.items() for k in keys}}
    (out / hfdir.INDEX).write_text(json.dumps(index))
    return out


def test_a_sharded_directory_loads_as_its_one_file(tmp_path):
    d = write_sharded(TINY_DIR, tmp_path / "sharded")
    ours, theirs = hfdir.load(d).state_dict(), hfdir.load(TINY_DIR).state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def _missing(d):
    (d / "model-00002-of-00002.safetensors").unlink()


def _stray(d):
    shutil.copy(TINY_DIR / "model.safetensors", d / "model.safetensors")  # a consolidated copy beside the shards


def _damaged(d):
    f = d / "model-00002-of-00002.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


@pytest.mark.parametrize("damage,words", [
    (_missing, "model.safetensors.index.json: names model-00002-of-00002.safetensors, which is missing from "),
    (_stray, "model.safetensors: a weight file model.safetensors.index.json does not name; move it out of "),
    (_damaged, "model-00002-of-00002.safetensors: unreadable safetensors file ("),
])
def test_a_sharded_directory_with_a_bad_file_is_one_line(tmp_path, damage, words):
    d = write_sharded(TINY_DIR, tmp_path / "sharded")
    damage(d)
    with pytest.raises(ValueError) as e:
        hfdir.load(d)
    assert words in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("damage,words", [
    (_missing, "which is missing from "), (_stray, "a weight file model.safetensors.index.json does not name"),
    (_damaged, "unreadable safetensors file")])
def test_train_refuses_a_bad_shard_in_one_line_and_writes_nothing(tmp_path, damage, words):
    d = write_sharded(TINY_DIR, tmp_path / "sharded")
    damage(d)
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), "--model", str(d), "--out-dir", str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and words in lines[0], r.stderr
    assert not (tmp_path / "run").exists()


WORKER = """
import sys
sys.path[:0] = [{root!r}]
import torch
from run import hfdir
from layers import lora
from layers import parallel as P
from pathlib import Path
P.setup_distributed("cpu")
whole = hfdir.load(Path(sys.argv[1]) / "sharded")  # the one-process load, the reference
out = {{}}
for case in ("sharded", "nan"):
    torch.manual_seed(0)
    model = hfdir.load_meta(Path(sys.argv[1]) / case)[0]
    lora.add(model, lora.LoRASpec(4, 8.0), "bf16", "cpu")
    adapters = {{n: p.detach() for n, p in model.named_parameters() if not p.is_meta}}
    P.shard(model)
    try:
        hfdir.fill_shards(model, Path(sys.argv[1]) / case, adapters, "cpu")
    except ValueError as e:
        out[case] = str(e)
        continue
    ref = whole.state_dict()
    local = {{n: (p.to_local().clone(), hfdir.rows(p).start) for n, p in model.named_parameters()}}
    out[case] = {{"local": local, "adapters": adapters, "ref": ref}}
torch.save(out, f"{{sys.argv[1]}}/rank{{P.RANK}}.pt")
torch.distributed.destroy_process_group()
"""


def test_two_ranks_each_read_their_own_rows_and_stop_on_the_same_line(tmp_path):
    """The sharded load on 2 gloo ranks: each rank's FSDP2 shard is its rows of the one-process load (a
    bf16 LoRA base rounded from the files' fp32, the adapters whole before sharding); a NaN that only
    rank 1's rows hold stops both ranks with the same line."""
    write_sharded(TINY_DIR, tmp_path / "sharded", torch.bfloat16)
    nan = write_sharded(TINY_DIR, tmp_path / "nan")
    f = nan / "model-00001-of-00002.safetensors"
    state = load_file(str(f))
    state["model.embed_tokens.weight"][-1, 0] = float("nan")  # the last row: rank 1's
    save_file(state, str(f), metadata={"format": "pt"})
    (tmp_path / "worker.py").write_text(WORKER.format(root=str(ROOT)))
    r = torchrun(str(tmp_path / "worker.py"), str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{i}.pt") for i in range(2)]
    want = f"{f}: model.embed_tokens.weight holds NaN or inf"
    assert ranks[0]["nan"] == ranks[1]["nan"] == want
    covered = {}
    for rank in ranks:
        got = rank["sharded"]
        for name, (local, start) in got["local"].items():
            source = got["adapters"][name] if name in got["adapters"] else got["ref"][name].to(local.dtype)
            assert torch.equal(local, source[start:start + local.shape[0]]), name
            covered[name] = covered.get(name, 0) + local.shape[0]
    assert all(n == ranks[0]["sharded"]["ref"].get(k, ranks[0]["sharded"]["adapters"].get(k)).shape[0]
               for k, n in covered.items())
    assert torch.equal(ranks[0]["sharded"]["adapters"]["model.layers.0.self_attn.q_proj.lora_A.weight"],
                       ranks[1]["sharded"]["adapters"]["model.layers.0.self_attn.q_proj.lora_A.weight"])
