"""torch.compile'd trainer forward and trainer step (forward, head and loss as one region) against
eager (compile is the default on CUDA), and the GPU checks bench/gpu.sh runs (skipped without CUDA)."""

import json

import pytest
import torch

from layers import attention as A
import model as M
from kernels import head
from engines.torch_engine import Sampling, TorchEngine


def _model(device="cpu"):
    m = M.Transformer(M.ModelArgs(vocab_size=32, **M.TINY))
    M.init_weights(m, std=0.1, seed=0)
    return m.to(device)


def _batch(device="cpu", T=96):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 32, (T,), generator=g)
    docs = torch.repeat_interleave(torch.arange(3), torch.tensor([40, 30, T - 70]))
    positions = torch.cat([torch.arange(40), torch.arange(30), torch.arange(T - 70)])
    return tokens.to(device), positions.to(device), docs.to(device)


def test_compiled_forward_equals_eager_and_does_not_recompile():
    torch._dynamo.reset()
    m = _model()
    compiled = torch.compile(m)
    tokens, positions, docs = _batch()
    with torch.no_grad():
        ref = m(tokens, positions, docs)
        out = compiled(tokens, positions, docs)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        with torch._dynamo.config.patch(error_on_recompile=True):  # new values, same shapes
            compiled(tokens.flip(0), positions, docs.flip(0))


gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@gpu
def test_cuda_forward_and_head_equal_cpu():
    m_cpu, m_gpu = _model(), _model("cuda")
    tokens, positions, docs = _batch()
    with torch.no_grad():
        ref = m_cpu(tokens, positions, docs)
        out = torch.compile(m_gpu)(*(x.cuda() for x in (tokens, positions, docs)))
        torch.testing.assert_close(out.cpu(), ref, atol=1e-4, rtol=1e-4)
        lp_ref = head(ref, m_cpu.head_weight, tokens)[0]
        lp = head(out, m_gpu.head_weight, tokens.cuda())[0]
        torch.testing.assert_close(lp.cpu(), lp_ref, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@gpu
def test_cuda_engine_logq_equals_full_forward():
    m = _model("cuda")
    engine = TorchEngine(m, "fp32", [2], seed=0, compile_step=True)
    prompt = [1, 5, 6, 7]
    out = engine.generate([prompt], 4, Sampling(top_p=0.9, max_new_tokens=12))
    for c in out:
        ids = torch.tensor(prompt + c.ids, device="cuda")
        with torch.no_grad():
            h = m(ids, torch.arange(len(ids), device="cuda"), torch.zeros_like(ids))
            logits = (h @ m.head_weight.T)[len(prompt) - 1:-1]
        # the sampled token's q over the top-p kept set, recomputed from the full forward
        probs = logits.softmax(-1).double()
        for t, (tok, lq) in enumerate(zip(c.ids, c.logq)):
            p, order = probs[t].sort(descending=True)
            keep = order[(p.cumsum(0) - p) < 0.9]
            assert tok in keep.tolist()
            ref = (probs[t, tok] / probs[t, keep].sum()).log().item()
            assert abs(lq - ref) < 1e-4


def _against_dense(monkeypatch, device: str, mode: str, grads: bool):
    """The packed forward under flex's BlockMask or `Rows` against the dense [T, T] mask: hidden
    states (and, with grads, every parameter's gradient), fp32; documents straddle 128-token
    blocks, and the second continues the first (a shared prompt: `parents`)."""
    import warnings

    warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
    tokens, positions, docs = _batch(device, T=300)
    parents = torch.where(docs == 1, 0, -1)
    runs = []
    for attention in ("dense", mode):
        m = _model(device)
        m.attention = attention
        with torch.set_grad_enabled(grads):
            h = m(tokens, positions, docs, parents)
            if grads:  # a loss of the size a real one has: O(1) gradients
                (h * torch.linspace(-1, 1, h.numel(), device=device).view_as(h)).mean().backward()
        runs.append((h.detach(), [p.grad for p in m.parameters()] if grads else []))
    assert isinstance(A.document_mask(docs, None, m.attention), A.BlockMask if mode == "flex" else A.Rows)  # it was on
    (h0, g0), (h1, g1) = runs
    torch.testing.assert_close(h1, h0, atol=1e-5, rtol=1e-5)
    for a, b in zip(g0, g1):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)


def test_flex_attention_equals_the_dense_mask(monkeypatch):
    """What CUDA runs, eagerly on the CPU (flex has no CPU backward: the gradients are the GPU test's)."""
    _against_dense(monkeypatch, "cpu", "flex", grads=False)


def test_cpu_rows_attention_and_its_gradients_equal_the_dense_mask(monkeypatch):
    _against_dense(monkeypatch, "cpu", "rows", grads=True)


def _packing(lengths, shared):
    """A packing of documents of these lengths; `shared` maps a document to its parent (a prompt)."""
    docs = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    positions = torch.cat([torch.arange(n) + (lengths[shared[d]] if d in shared else 0) for d, n in enumerate(lengths)])
    parents = torch.tensor([shared.get(int(d), -1) for d in docs])
    tokens = torch.randint(0, 32, (len(docs),), generator=torch.Generator().manual_seed(len(lengths)))
    return tokens, positions, docs, parents


def test_a_compiled_cpu_forward_takes_rows_and_one_graph_serves_every_packing(monkeypatch):
    """Under torch.compile on a CPU the packed attention is `Rows` (the op floe::rows_attention),
    not the dense [T, T] mask: over packings of one [T] buffer, with and without shared prompts,
    and buffers trimmed to other lengths (train.prepare: a multiple of 64), the compiled forward
    (dynamic, as run/start.py builds it on a CPU) gives the eager `Rows` forward's hidden states and
    every gradient (fp32: float noise in the fused parts, 1e-5), and only the first builds a graph."""
    torch._dynamo.reset()
    built = []
    attend_documents = A._attend_documents
    monkeypatch.setattr(A, "_attend_documents", lambda *args: built.append(1) or attend_documents(*args))
    eager, m = _model(), _model()
    fwd = M.compiled(m, "trainer forward", dynamic=True)
    packings = [_packing([30, 20, 20, 26], {1: 0, 2: 0}), _packing([64, 32], {}), _packing([10, 40, 9, 9, 28], {3: 2, 4: 2}),
                _packing([50, 14], {1: 0}), _packing([100, 60, 60, 36, 64], {1: 0, 2: 0, 4: 3})]
    assert sorted({len(p[0]) for p in packings}) == [64, 96, 320]
    for i, batch in enumerate(packings):
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            out = [f(*batch) for f in (eager, fwd)]
        for h in out:
            (h * torch.linspace(-1, 1, h.numel()).view_as(h)).mean().backward()
        torch.testing.assert_close(out[1], out[0], atol=1e-5, rtol=1e-5)
        for a, b in zip(eager.parameters(), m.parameters()):
            torch.testing.assert_close(b.grad, a.grad, atol=1e-5, rtol=1e-4)
            a.grad = b.grad = None
    assert built, "the compiled forward did not run floe::rows_attention"


def test_the_rows_attention_op_is_registered_right():
    """torch.library's own check of floe::rows_attention: its fake (shapes and strides), its
    autograd formula against the op's gradients, and Dynamo's view of it."""
    tokens, positions, docs, parents = _packing([12, 8, 6, 14], {1: 0, 2: 0})
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, n, len(docs), 8, generator=g).transpose(1, 2).contiguous().transpose(1, 2).requires_grad_()
               for n in (4, 2, 2))
    for par in (parents, None):
        torch.library.opcheck(A.rows_attention, (q, k, v, docs, par))


def test_flex_attention_under_autocast_gets_one_dtype(monkeypatch):
    """--train-dtype bf16/fp16 on CUDA: RoPE (fp32 cos/sin) and qk-norm leave q and k in fp32 while
    v is the autocast dtype, and inductor's flex backward refuses mixed dtypes. flex must get q, k, v
    in one dtype, and its bf16 forward must stay as near the fp32 one as the dense mask's (SDPA, which
    autocast casts to bf16)."""
    import warnings

    warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
    seen = []

    def spy(q, k, v, **kw):
        seen.append((q.dtype, k.dtype, v.dtype))
        return flex(q, k, v, **kw)

    flex = A.flex_attention
    monkeypatch.setattr(A, "flex_attention", spy)
    tokens, positions, docs = _batch(T=300)
    parents = torch.where(docs == 1, 0, -1)
    m = _model()
    with torch.no_grad():
        ref = m(tokens, positions, docs, parents)  # fp32, dense
        err = {}
        for attention in ("dense", "flex"):
            m.attention = attention
            with torch.autocast("cpu", torch.bfloat16):
                err[attention] = ((m(tokens, positions, docs, parents).float() - ref).norm() / ref.norm()).item()
    assert seen and all(d == (torch.bfloat16,) * 3 for d in seen), seen
    assert 0 < err["flex"] < 1.5 * err["dense"], err


@pytest.mark.gpu
@gpu
def test_cuda_flex_attention_and_its_gradients_equal_the_dense_mask(monkeypatch):
    _against_dense(monkeypatch, "cuda", "flex", grads=True)


def test_compile_on_a_cpu_without_a_compiler_runs_eager_with_one_line(tmp_path, monkeypatch, capsys):
    import shutil

    import train

    monkeypatch.setattr(shutil, "which", lambda name: None)  # no g++, no clang++, no $CXX
    train.main(["--compile", "on", "--steps", "1", "--prompts-per-step", "2", "--group-size", "2",
                "--max-new-tokens", "4", "--eval-every", "0", "--out-dir", str(tmp_path)])
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if "C++ compiler" in line]
    assert len(notes) == 1 and notes[0].startswith("note: --compile on")
    assert (tmp_path / "final").exists()
    # settled once at the start (start.settled): every part of the run saw "off", the log line and
    # the run's record included
    assert "compiling" not in out and json.loads((tmp_path / "config.json").read_text())["compile"] == "off"


def test_graphs_counts_a_recompile_after_warm_up_and_names_its_guard():
    """runlog.Graphs against Dynamo itself: warm-up's graphs are counted and not warned about; a
    new shape after warm-up is one line naming the function and the guard that failed."""
    from types import SimpleNamespace

    from run.runlog import Graphs

    def doubled(x):
        return x * 2

    assert Graphs(SimpleNamespace(compile="off"), {"doubled": doubled}).row() == {}
    torch._dynamo.reset()
    g, fn = Graphs(SimpleNamespace(compile="on"), {"doubled": doubled, "unused": _model}), torch.compile(doubled)
    fn(torch.ones(3))  # step 1
    m = g.row()
    assert m == {"compile/graphs": 1, "compile/new_graphs": 1} and g.check(1, m) == []
    fn(torch.ones(3))  # step 3: nothing new
    m = g.row()
    assert m["compile/new_graphs"] == 0 and g.check(3, m) == []
    fn(torch.ones(2, 2))  # step 4: another rank, so another graph
    m = g.row()
    lines = g.check(4, m)
    assert m == {"compile/graphs": 2, "compile/new_graphs": 1} and len(lines) == 1
    assert lines[0].startswith("warning: step 4: torch.compile built 1 new graph after warm-up")
    assert "doubled (test_compile.py:" in lines[0] and "rank mismatch" in lines[0]
    assert g.summary() == {"compile/regions": ["doubled"]}


def test_a_compiled_job_builds_no_graph_after_warm_up(tmp_path):
    """The default task's prompts and completions vary in length: with --compile on every row
    counts the graphs, none is built after warm-up, the summary names the regions that ran
    compiled, and the exit finds no thread left behind (Inductor's compile pool is closed)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, "train.py", "--compile", "on", "--steps", "5", "--eval-every", "0",
                        "--max-new-tokens", "12", "--out-dir", str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=600, cwd=root)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in rows] == [1, 2, 3, 4, 5]
    assert rows[0]["compile/new_graphs"] >= 2  # the trainer step and the decode step
    assert [x["compile/new_graphs"] for x in rows[2:]] == [0, 0, 0]
    assert rows[-1]["compile/graphs"] == sum(x["compile/new_graphs"] for x in rows)
    assert "torch.compile built" not in r.stdout and "user code started" not in r.stdout
    summary = json.loads(next(x for x in r.stdout.splitlines() if x.startswith("summary "))[len("summary "):])
    assert summary["compile/regions"] == ["trainer step", "engine decode step"]  # no pi_old pass: no trainer forward


COUNTED = """
import json, sys
sys.path.insert(0, {root!r})
import train
from torch._dynamo.utils import counters
try:
    train.main(sys.argv[1:])
finally:
    print("counters " + json.dumps({{k: dict(counters[k]) for k in ("aot_autograd", "inductor")}}))
"""


def test_a_second_start_finds_every_graph_in_the_compile_caches(tmp_path):
    """Inductor's FX-graph cache and AOTAutograd's cache (on disk, TORCHINDUCTOR_CACHE_DIR): the second
    start of a compiled job misses and bypasses neither for any graph, so it pays no compile. Caught two
    causes: a disabled autocast in the trainer step's graph (AOTAutograd bypasses its cache) and
    symbolic floats, which restart Dynamo's analysis and throw the first attempt away (model.compiled)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache")}
    seen = []
    for run in ("cold", "warm"):
        r = subprocess.run([sys.executable, "-c", COUNTED.format(root=str(root)), "--compile", "on", "--steps", "2",
                            "--eval-every", "0", "--max-new-tokens", "12", "--out-dir", str(tmp_path / run)],
                           capture_output=True, text=True, timeout=600, cwd=root, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        seen.append(json.loads(next(x for x in r.stdout.splitlines() if x.startswith("counters "))[len("counters "):]))
    cold, warm = seen
    assert cold["aot_autograd"].get("autograd_cache_saved", 0) >= 2, cold  # the trainer step and the decode step
    assert warm["aot_autograd"].get("autograd_cache_hit", 0) == cold["aot_autograd"]["autograd_cache_saved"], warm
    assert not {k for k in warm["aot_autograd"] if "miss" in k or "bypass" in k}, warm
    assert not {k for k in warm["inductor"] if k.startswith("fxgraph_cache") and k != "fxgraph_cache_hit"}, warm


def test_a_compiler_failure_falls_back_to_eager_with_one_line_per_region(tmp_path, capsys, monkeypatch):
    """Inductor raising at the first call (here by a patched compile_fx) costs the run nothing but
    its speed: one line per region, the run ends, and compile/regions lists no region."""
    import torch._inductor.compile_fx as inductor

    import train

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ toolchain works today")

    torch._dynamo.reset()
    monkeypatch.setattr(inductor, "compile_fx", broken)
    summary = train.main(["--compile", "on", "--steps", "2", "--prompts-per-step", "2", "--group-size", "2",
                          "--max-new-tokens", "4", "--eval-every", "0", "--out-dir", str(tmp_path)])
    notes = [x for x in capsys.readouterr().out.splitlines() if x.startswith("note: torch.compile failed")]
    assert sorted(x.split(" (")[0] for x in notes) == ["note: torch.compile failed on the engine decode step",
                                                        "note: torch.compile failed on the trainer step"]
    assert all("(BackendCompilerFailed: RuntimeError: no C++ toolchain works today); it runs eager" in x for x in notes)
    assert summary["compile/regions"] == [] and (tmp_path / "final").exists()
    torch._dynamo.reset()


@pytest.mark.parametrize("device, dtype, static", [("cpu", "fp32", False), ("cpu", "bf16", False), ("cpu", "fp8", False),
                                                   ("cpu", "fp32", True),
                                                   pytest.param("cuda", "fp32", True, marks=[pytest.mark.gpu, gpu])])
def test_a_push_changes_the_next_draws_of_a_compiled_decode_step(device, dtype, static):
    """A compiled decode step holds the engine's weight tensors: a push must reach it (every weight,
    the fp8 head's e4m3 copy too, is overwritten in place), so the draws after it are those of an
    eager engine built from the pushed weights, and not the old weights' draws. Static (the CUDA
    default): the step replays as a CUDA graph there, captured on the weights' addresses, and no
    graph is skipped (Inductor's cudagraph_skips: an input it cannot keep at one address)."""
    from torch._dynamo.utils import counters

    from test_engines import PROMPTS, STOPS

    torch._dynamo.reset()
    counters.clear()
    old, new = _model(device), M.Transformer(M.ModelArgs(vocab_size=32, **M.TINY))
    M.init_weights(new, std=0.15, seed=1)
    new = new.to(device)
    engine = TorchEngine(old, dtype, STOPS, compile_step=True, static=static)
    assert engine.graphs == (device == "cuda")
    s = Sampling(temperature=1.0, max_new_tokens=8, seed=5)
    before = engine.generate(PROMPTS, 4, s)
    head8 = engine.head8
    engine.load_weights(new, 1)
    after = engine.generate(PROMPTS, 4, s)
    ref = TorchEngine(new, dtype, STOPS, static=static).generate(PROMPTS, 4, s)
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert engine.head8 is head8  # fp8: the same e4m3 copy, new values (None otherwise)
    assert [c.ids for c in after] == [c.ids for c in ref] != [c.ids for c in before]
    # fp32 and fp8 (whose roundings absorb the summation order) to 1e-4; bf16's logits are rounded
    # after an fp32 sum in another order, which may flip a rounding: one bf16 step of a logit near 4
    # is 1.6e-2 (emulate_precision_casts keeps the roundings themselves: without it bf16 draws differ)
    tol = 2e-2 if dtype == "bf16" else 1e-4
    for a, r in zip(after, ref):
        torch.testing.assert_close(torch.tensor(a.logq), torch.tensor(r.logq), atol=tol, rtol=0)
        assert a.versions == [1] * len(a.ids)


def test_a_static_decode_equals_the_per_call_one_and_builds_one_graph_per_cache():
    """The static decode (the CUDA default; engines/kvcache.py `Slots`), compiled, on a CPU: the same
    draws as the per-call cache's eager decode with no row leaving the batch (the same random
    stream), logq to 1e-4 (the padding rows and the longer, masked cache change only summation
    order); one graph per cache it decodes into, whatever the calls' prompt lengths, group sizes
    and budgets: a longer call's doubled cache, and a call made inside another's decode (an eval in a
    partial rollout's `between`), which gets a cache of its own and leaves the waiting rows alone."""
    from torch._dynamo.utils import counters

    from test_engines import STOPS

    torch._dynamo.reset()
    counters.clear()
    m = _model()
    static = TorchEngine(m, "fp32", STOPS, seed=3, compile_step=True, static=True)
    ref = TorchEngine(m, "fp32", STOPS, seed=3)
    ref.syncs = False  # the per-call decode loop a GPU runs without `static`: no row leaves the batch
    calls = [([[1, 5, 6, 7, 8], [1, 9, 10, 11]], 4, 8), ([[1, 3], [1, 4, 4], [1, 9, 10, 11, 12, 13]], 2, 12),
             ([[1, 7, 7]], 5, 6), ([[1, 5, 6]], 6, 70)]  # 8, 6, 5, 6 rows: width 8; lengths 64, 64, 64, 128
    graphs = []
    for prompts, n, budget in calls:
        s = Sampling(max_new_tokens=budget)
        for a, b in zip(static.generate(prompts, n, s), ref.generate(prompts, n, s)):
            assert a.ids == b.ids
            torch.testing.assert_close(torch.tensor(a.logq), torch.tensor(b.logq), atol=1e-4, rtol=0)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs == [1, 1, 1, 2]
    assert list(static.slots.caches) == [(8, 0)] and static.slots.caches[(8, 0)].max_len == 128  # replaced
    inner, outer = [], Sampling(max_new_tokens=8, seed=1)

    def eval_inside():  # once, at the first decode step (the inner call's own steps find `inner` set)
        if not inner:
            inner.append(True)
            static.generate([[1, 4], [1, 6]], 4, Sampling(max_new_tokens=4, seed=2))

    static.between = eval_inside
    nested = static.generate([[1, 5, 6, 7, 8], [1, 9, 10, 11]], 4, outer)
    static.between = None
    alone = static.generate([[1, 5, 6, 7, 8], [1, 9, 10, 11]], 4, outer)
    assert [c.ids for c in nested] == [c.ids for c in alone]  # the eval inside wrote none of the waiting rows
    assert (8, 1) in static.slots.caches and counters["stats"]["unique_graphs"] == 3 and not static.slots.busy


NEW_LOSSES = {  # the 2026 corrections, each with DPPO's directional mask and Kimi K2.5's (log r)^2 term
    "sapo+icepop": ("sapo", True, dict(kl_mask="binary_tv", kl_mask_threshold=0.1)),
    "topr": ("topr", False, dict(kl_mask="binary", kl_mask_threshold=0.05)),
    "tis+m2po": ("tis", False, dict(kl_mask="binary_tv", kl_mask_threshold=0.1, seq_mask="max", seq_mask_low=0.2,
                                    seq_mask_high=4.0, m2po_threshold=0.5)),
}


@pytest.mark.parametrize("name", list(NEW_LOSSES))
def test_the_new_losses_compile_whole_and_equal_eager(name):
    """rl_loss under torch.compile (Inductor, one graph: fullgraph=True refuses a break) against eager, fp64:
    loss, logit gradient and every metric within rtol 1e-10 / atol 1e-13 (only the summation order differs)."""
    import loss as L
    from layers.masks import m2po_bound, reduce_metrics
    from loss_reference import STEP, assemble, cfg_for, head, make_docs

    torch._dynamo.reset()
    loss_type, icepop, extra = NEW_LOSSES[name]
    cfg = cfg_for(loss_type, icepop_mask=icepop, kl_mask_directional=True, log_ratio_coeff=0.3, **extra)
    mb, logits, noise = assemble(make_docs("replayed"), T=24)
    denom = L.denominators([mb])
    if cfg.m2po_threshold:  # the step's bound on (log pi_old/q)^2, found before the loss as train.py finds it
        denom.m2_max = m2po_bound([head(logits, mb)[0].detach() + noise], [mb], cfg.m2po_threshold)
    out = []
    for fn in (L.rl_loss, torch.compile(L.rl_loss, fullgraph=True)):
        logp, slogp, ent = head(logits, mb)
        loss, m = fn(logp, slogp, ent, mb, cfg, denom, STEP, old_logp=logp.detach() + noise)
        out.append((loss, torch.autograd.grad(loss, logits)[0], reduce_metrics(m)))
    (l0, g0, m0), (l1, g1, m1) = out
    assert torch.allclose(l0, l1, rtol=1e-10, atol=1e-13) and torch.allclose(g0, g1, rtol=1e-10, atol=1e-13)
    assert set(m0) == set(m1) and all(m1[k] == pytest.approx(v, rel=1e-10, abs=1e-13) for k, v in m0.items())
    assert m0["kl_mask/masked_fraction"] > 0 and m0["log_ratio_sq"] > 0
    assert not cfg.m2po_threshold or 0 < m0["m2po/masked_fraction"] < 1


STEP_JOBS = {  # the trainer step's region: (Config fields, graph breaks it may have, graphs it builds)
    "icepop": (dict(loss="icepop", icepop_alpha=0.8, icepop_beta=1.25), {}, 1),  # centered: reads the support rows
    "ppo+icepop-mask+kl-exact+m2po": (dict(loss="ppo", icepop_mask=True, icepop_alpha=0.8, icepop_beta=1.25, kl_coeff=0.1,
                                           kl_estimator="exact", m2po_threshold=0.05, epochs=2), {}, 1),
    "sft": (dict(stage="sft"), {}, 1),
    # the CPU reference's sparse backward and a head of several chunks run eager (kernels._sparse_head,
    # kernels._sliced): one break each, a graph on either side
    "reinforce+top-p (sparse backward)": (dict(loss="reinforce", top_p=0.9), {"_sparse_head": 1}, 2),
    "icepop, the head in chunks": (dict(loss="icepop", icepop_alpha=0.8, icepop_beta=1.25), {"_sliced": 1}, 2),
}


@pytest.mark.parametrize("job", list(STEP_JOBS))
def test_the_trainer_step_compiles_as_one_region_equals_eager_and_builds_no_graph_per_micro_batch(job, monkeypatch):
    """--compile on's `trainer step` (run/start.py trainer_step: train.micro_loss, the forward, head and loss of
    a micro-batch) against eager train.backward_pass, on the same batches and weights, fp32: the loss and
    every metric to rtol 1e-5, every gradient to atol 1e-5 / rtol 1e-4 (Inductor sums in other orders).
    Three batches of other packings, support sizes, denominators and steps (and M2PO bounds) after the first
    build no graph (error_on_recompile), and the region holds no graph break but the ones it names."""
    import dataclasses

    import config as C
    import kernels
    import train
    from layers.masks import m2po_bound, reduce_metrics
    from run.start import trainer_step
    from test_train import _samples, _setup
    from torch._dynamo.utils import counters

    fields, breaks, graphs = STEP_JOBS[job]
    if job.endswith("chunks"):
        monkeypatch.setattr(kernels, "TILE_ELEMENTS", 32 * 48)  # 48 tokens a chunk at V = 32
    torch._dynamo.reset()
    counters.clear()
    codec, m, task = _setup()
    cfg = C.Config(prompts_per_step=4, group_size=3, max_new_tokens=10, compile="on", device="cpu", **fields)
    region = trainer_step(cfg, train.micro_loss)
    eager, compiled = (M.Transformer(m.args) for _ in range(2))
    samples = _samples(cfg, m, codec, task)
    g = torch.Generator().manual_seed(1)
    for i, (T, keep, step) in enumerate([(128, 12, 3), (192, 9, 4), (256, 11, 7)]):
        c = dataclasses.replace(cfg, micro_batch_tokens=T)
        mbs, denom, _ = train.prepare(c, samples[:keep], 32, "cpu")
        with torch.no_grad():  # pi_old as train.old_logprobs gives it, a little off the current weights
            old = [train._head(c, m, m, mb)[0] + 0.05 * torch.randn(len(mb.tokens), generator=g) for mb in mbs]
        if c.m2po_threshold:
            denom.m2_max = m2po_bound(old, mbs, c.m2po_threshold)
        out = []
        for model, r in ((eager, None), (compiled, region)):
            model.load_state_dict(m.state_dict())
            with torch._dynamo.config.patch(error_on_recompile=i > 0):
                metrics = train.backward_pass(c, model, model, mbs, denom, step, old, region=r)
            out.append((reduce_metrics(metrics), [p.grad for p in model.parameters()]))
            model.zero_grad(set_to_none=True)
        (m0, g0), (m1, g1) = out
        assert m0.keys() == m1.keys() and all(m1[k] == pytest.approx(v, rel=1e-5, abs=1e-6) for k, v in m0.items()), job
        for a, b in zip(g0, g1):
            torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-4)
    assert len({len(mb.tokens) for mb in mbs}) >= 1 and counters["stats"]["unique_graphs"] == graphs
    got = {next(n for n in ("_sparse_head", "_sliced") if n in k) if "disable" in k else k: v
           for k, v in counters["graph_break"].items()}
    assert got == breaks, dict(counters["graph_break"])
    if fields.get("stage") != "sft":  # it ran what it claims to
        assert any(k.startswith(("icepop/", "ppo/", "kl")) or k == "mismatch/kl" for k in m0)
    torch._dynamo.reset()


def test_the_trainer_step_on_cuda_shapes_builds_one_graph_for_every_count():
    """CUDA's region (run/start.py trainer_step) is static in [T] (every buffer is [T]) but for the support's
    [nnz], and takes the denominators and the step as tensors: over batches of other support sizes, token
    and sequence counts and steps, the first micro-batch's graph serves every later one (here on CPU
    tensors: the head's torch reference; the Triton head's custom ops are CUDA's own, untested here)."""
    import config as C
    import data as D
    import loss as L
    import train
    from run.start import trainer_step
    from test_train import _samples, _setup
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    codec, m, task = _setup()
    cfg = C.Config(loss="icepop", icepop_alpha=0.8, icepop_beta=1.25, prompts_per_step=4, group_size=3,
                   max_new_tokens=10, compile="on", device="cuda")  # cuda: trainer_step's static shapes
    region = trainer_step(cfg, train.micro_loss)
    samples = _samples(cfg, m, codec, task)
    for i, (keep, step) in enumerate([(12, 3), (7, 4), (10, 9)]):
        mbs = D.pack(samples[:keep], 256)  # untrimmed, as on CUDA
        denom = L.denominators(mbs)
        with torch._dynamo.config.patch(error_on_recompile=i > 0):
            train.backward_pass(cfg, m, m, mbs, denom, step, region=region)
        m.zero_grad(set_to_none=True)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    torch._dynamo.reset()
