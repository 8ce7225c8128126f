"""The Triton head (kernels.py `triton_head`, its kernels in layers/headkernels.py) against the plain-torch
reference (kernels.py `head`).

CPU: the kernels run in Triton's interpreter at tiny shapes (fp32: tl.dot on bf16 is wrong
there), against head(impl="torch"): the forward over every kind of row, the dense and the
sparse backward, bit-identical reruns, torch.compile. Triton picks interpret-or-compile when
it is first imported, and other test files may import it first (vLLM does), so a plain
`pytest` run starts these tests in a subprocess with TRITON_INTERPRET=1
(test_interpreter_in_subprocess) and skips them in its own process; to see them one by one:

    TRITON_INTERPRET=1 python -m pytest -q -m "not gpu" tests/test_triton.py

Also on the CPU: floe imports and runs without triton; every kernel compiles for an H200
(sm_90) with the GPU tiles, as Triton would specialize it at N=16k, H=2048, V=151936.
GPU (`-m gpu`, bench/gpu.sh): the compiled kernels against the reference at moderate shapes,
bf16 and fp32, and a bit-identical sparse backward.
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import kernels
from data import TokenSupport
from kernels import head
from layers import headkernels

ROOT = Path(__file__).resolve().parent.parent
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
HAS_TRITON = kernels.triton_available()
interpreted = pytest.mark.skipif(not (INTERPRET and HAS_TRITON),
                                 reason="runs in test_interpreter_in_subprocess (TRITON_INTERPRET=1)")
gpu = pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TRITON) or INTERPRET,
                         reason="needs CUDA and triton, not the interpreter")


# ----------------------------------------------------------------------------- problems

def _support(kinds, labels, V, gen, pool=6, max_row=5):
    """One row per kind: "empty"; "replayed" (distinct ids holding the label); "draws" (ids
    drawn with replacement from the first `pool`, so they repeat within and across rows)."""
    ids, offs, rep = [], [0], []
    for t, kind in enumerate(kinds):
        k = int(torch.randint(1, max_row + 1, (1,), generator=gen))
        if kind == "replayed":
            others = [v for v in torch.randperm(V, generator=gen).tolist() if v != int(labels[t])]
            row = [int(labels[t])] + others[:k - 1]
        elif kind == "draws":
            row = torch.randint(0, pool, (k,), generator=gen).tolist()
        else:
            row = []
        ids += row
        offs.append(offs[-1] + len(row))
        rep.append(kind == "replayed")
    host = np.array(offs, dtype=np.int64)
    return TokenSupport(torch.tensor(ids, dtype=torch.int32), torch.from_numpy(host.copy()),
                        -torch.rand(len(ids), generator=gen), torch.tensor(rep), host)


KINDS = {"mixed": ["replayed", "draws", "empty", "draws", "replayed", "replayed", "empty", "draws"] * 2,
         "replayed": ["replayed"] * 13, "draws": ["draws"] * 13, "empty": ["empty"] * 13, "none": None}


def _problem(kinds, N=13, H=12, V=37, seed=0, dtype=torch.float32, device="cpu", **support_kw):
    gen = torch.Generator().manual_seed(seed)
    N = N if kinds is None else len(kinds)
    hidden = torch.randn(N, H, generator=gen)
    weight = torch.randn(V, H, generator=gen) * H**-0.5
    labels = torch.randint(0, 6, (N,), generator=gen)  # labels repeat across tokens
    support = None if kinds is None else _support(kinds, labels, V, gen, **support_kw)
    hidden, weight = (x.to(device, dtype).requires_grad_() for x in (hidden, weight))
    return hidden, weight, labels.to(device), None if support is None else support.to(device)


def _coefs(support, N, gen, centered):
    """Coefficients on (logp, support_logp). centered: valid for the sparse backward (any on a
    replayed row, g_logp = -sum(g_slp) on any other, so G_t = 0 there)."""
    if support is None:
        return torch.randn(N, generator=gen, dtype=torch.float64), torch.zeros(0, dtype=torch.float64)
    cs = torch.randn(support.nnz, generator=gen, dtype=torch.float64)
    rows = torch.repeat_interleave(torch.arange(N), torch.from_numpy(np.diff(support.host_offsets)))
    row_sum = torch.zeros(N, dtype=torch.float64).index_add(0, rows, cs)
    cl = torch.randn(N, generator=gen, dtype=torch.float64)
    if centered:
        cl = torch.where(support.replayed.cpu(), cl, -row_sum)
    return cl, cs


def _run(hidden, weight, labels, support, cl, cs, T, impl, sparse=False, backward_gemm="triton"):
    logp, ent, slp = head(hidden, weight, labels, support, T, sparse=sparse, impl=impl, backward_gemm=backward_gemm)
    dev = hidden.device
    loss = (logp.double() * cl.to(dev)).sum() + (slp.double() * cs.to(dev)).sum()
    wanted = [x for x in (hidden, weight) if x.requires_grad]
    return (logp, ent, slp), torch.autograd.grad(loss, wanted)


def _close(a, b, atol=1e-5):
    torch.testing.assert_close(a.double(), b.double(), atol=atol, rtol=0)


# ----------------------------------------------------------------------------- CPU, in the interpreter

@interpreted
@pytest.mark.parametrize("kinds", list(KINDS))
def test_forward_matches_reference(kinds):
    hidden, weight, labels, support = _problem(KINDS[kinds])
    with torch.no_grad():
        ref = head(hidden, weight, labels, support, 0.7, impl="torch")
        out = head(hidden, weight, labels, support, 0.7, impl="triton")
    for a, b in zip(out, ref):
        assert a.dtype == torch.float32 and a.shape == b.shape
        _close(a, b)


@interpreted
@pytest.mark.parametrize("kinds", ["mixed", "none"])
@pytest.mark.parametrize("gemm", ["triton", "torch"])
def test_dense_backward_matches_reference(kinds, gemm):
    hidden, weight, labels, support = _problem(KINDS[kinds], seed=1)
    cl, cs = _coefs(support, hidden.shape[0], torch.Generator().manual_seed(2), centered=False)
    (logp, ent, slp), (dh, dw) = _run(hidden, weight, labels, support, cl, cs, 0.7, "triton", backward_gemm=gemm)
    ref, (rh, rw) = _run(hidden, weight, labels, support, cl, cs, 0.7, "torch")
    assert not ent.requires_grad and logp.requires_grad
    for a, b in zip((logp, ent, slp, dh, dw), (*ref, rh, rw)):
        _close(a, b)


@interpreted
@pytest.mark.parametrize("kinds", ["replayed", "draws", "mixed"])
def test_sparse_backward_matches_reference(kinds):
    hidden, weight, labels, support = _problem(KINDS[kinds], seed=3)
    cl, cs = _coefs(support, hidden.shape[0], torch.Generator().manual_seed(4), centered=True)
    _, (dh, dw) = _run(hidden, weight, labels, support, cl, cs, 0.7, "triton", sparse=True)
    _, (sh, sw) = _run(hidden, weight, labels, support, cl, cs, 0.7, "torch", sparse=True)
    _, (rh, rw) = _run(hidden, weight, labels, support, cl, cs, 0.7, "torch", sparse=False)
    for a, b, c in ((dh, sh, rh), (dw, sw, rw)):
        _close(a, b)  # the reference's sparse backward
        _close(a, c)  # and the exact (dense) gradient
        assert a.dtype == torch.float32


@interpreted
@pytest.mark.parametrize("sparse", [True, False])
def test_backward_is_bit_identical(sparse):
    kinds = (["draws"] * 3 + ["replayed"] * 3 + ["empty"]) * 4  # ids repeat: many triples per W row
    hidden, weight, labels, support = _problem(kinds, H=16, V=24, seed=5, pool=4)
    cl, cs = _coefs(support, hidden.shape[0], torch.Generator().manual_seed(6), centered=True)
    runs = [_run(hidden, weight, labels, support, cl, cs, 1.0, "triton", sparse=sparse) for _ in range(2)]
    (f0, g0), (f1, g1) = runs
    assert all(torch.equal(a, b) for a, b in zip(f0 + g0, f1 + g1))


@interpreted
def test_frozen_weight_and_temperature():
    hidden, weight, labels, support = _problem(KINDS["mixed"], seed=7)
    weight = weight.detach()  # only d_hidden is asked for: the kernels skip d_W
    cl, cs = _coefs(support, hidden.shape[0], torch.Generator().manual_seed(8), centered=True)
    for sparse in (False, True):
        _, (dh,) = _run(hidden, weight, labels, support, cl, cs, 0.5, "triton", sparse=sparse)
        _, (rh,) = _run(hidden, weight, labels, support, cl, cs, 0.5, "torch", sparse=sparse)
        _close(dh, rh)


@interpreted
def test_bf16_inputs_run_on_fp32_copies():
    """In the interpreter the kernels upcast bf16 inputs; outputs fp32, gradients bf16."""
    hidden, weight, labels, support = _problem(KINDS["mixed"], seed=9, dtype=torch.bfloat16)
    cl, cs = _coefs(support, hidden.shape[0], torch.Generator().manual_seed(10), centered=False)
    (logp, _, slp), (dh, dw) = _run(hidden, weight, labels, support, cl, cs, 1.0, "triton")
    h32, w32 = (x.detach().float().requires_grad_() for x in (hidden, weight))
    (rl, _, rs), (rh, rw) = _run(h32, w32, labels, support, cl, cs, 1.0, "torch")
    assert logp.dtype == torch.float32 and dh.dtype == dw.dtype == torch.bfloat16
    _close(logp, rl)
    _close(slp, rs)
    torch.testing.assert_close(dh.float(), rh, atol=2e-2, rtol=1e-2)  # one bf16 rounding
    torch.testing.assert_close(dw.float(), rw, atol=2e-2, rtol=1e-2)


@interpreted
def test_composes_with_torch_compile():
    """Custom ops with fake implementations: one graph (fullgraph), the same values and grads."""
    hidden, weight, labels, support = _problem(KINDS["mixed"], seed=11)

    def loss(hidden, weight, labels, support):
        logp, ent, slp = head(hidden, weight, labels, support, 0.7, impl="triton")
        return (logp * ent).sum() + slp.square().sum()

    ref = loss(hidden, weight, labels, support)
    ref_grads = torch.autograd.grad(ref, (hidden, weight))
    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    out = compiled(hidden, weight, labels, support)
    for a, b in zip((out, *torch.autograd.grad(out, (hidden, weight))), (ref, *ref_grads)):
        _close(a, b, atol=1e-6)


# ----------------------------------------------------------------------------- CPU, in this process

@pytest.mark.skipif(INTERPRET or not HAS_TRITON, reason="the interpreter's own process")
def test_interpreter_in_subprocess():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "not gpu", "-p", "no:cacheprovider", __file__],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    print(out.stdout[-600:])
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-3000:]
    assert " passed" in out.stdout and "skipped" in out.stdout  # ran the interpreted tests; skipped this one


@pytest.mark.skipif(INTERPRET, reason="runs in the main process")
def test_runs_without_triton():
    """floe imports, and the head runs on the reference, where triton does not import."""
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch, kernels\n"
            "assert not kernels.triton_available()\n"
            "h = torch.randn(5, 4, requires_grad=True); w = torch.randn(9, 4, requires_grad=True)\n"
            "logp, ent, slp = kernels.head(h, w, torch.tensor([1, 2, 3, 4, 5]))\n"
            "logp.sum().backward(); assert h.grad is not None\n"
            "try:\n    kernels.head(h, w, torch.tensor([1, 2, 3, 4, 5]), impl='triton')\n"
            "except ImportError:\n    print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def _sm90_jobs(t, N=16384, H=2048, V=151936, W=8192):
    """Each kernel's arguments as Triton's launcher would specialize them (pointers and
    multiples of 16 aligned, ones constant) at the bench shape in bf16; dlogits width W."""
    i = lambda v: ("i32", v)  # noqa: E731
    P, F, L, I, inv_t = "*bf16", "*fp32", "*i64", "*i32", ("fp32", 1.0)
    tiled = dict(BLOCK_N=t.n, BLOCK_V=t.v, BLOCK_H=t.h, PREC="tf32")
    mm = dict(BLOCK_M=t.mm[0], BLOCK_N=t.mm[1], BLOCK_K=t.mm[2], GROUP_M=t.group, PREC="tf32")
    gather = dict(BLOCK_H=t.row_h)
    return [
        ("lse_kernel", dict(h_ptr=P, w_ptr=P, m_ptr=F, s_ptr=F, a_ptr=F, N=i(N), V=i(V), H=i(H), v_per_split=i(30464),
                            inv_t=inv_t, stride_h=i(H), stride_w=i(H)), tiled, t.warps),
        ("support_kernel", dict(h_ptr=P, w_ptr=P, labels_ptr=L, ids_ptr=I, offsets_ptr=L, label_ptr=F, raw_ptr=F,
                                lse_s_ptr=F, H=i(H), inv_t=inv_t, stride_h=i(H), stride_w=i(H)),
         dict(gather, BLOCK_E=t.rows), headkernels.GATHER_WARPS),
        ("softmax_grad_kernel", dict(h_ptr=P, w_ptr=P, lse_ptr=F, scale_ptr=F, toks_ptr=L, cols_ptr=L, coefs_ptr=F,
                                     bucket_ptr=L, dl_ptr=P, N=i(N), v_lo=i(0), v_hi=i(W), H=i(H), inv_t=inv_t,
                                     stride_h=i(H), stride_w=i(H), stride_dl=i(W)), dict(tiled, BLOCK_R=t.rows), t.warps),
        ("matmul_kernel", dict(a_ptr=P, b_ptr=P, c_ptr=F, M=i(N), N=i(H), K=i(W), stride_am=i(W), stride_ak=i(1),
                               stride_bk=i(H), stride_bn=i(1), stride_cm=i(H), stride_cn=i(1)),
         dict(mm, ACCUMULATE=True), t.warps),  # d_hidden += dlogits @ W[chunk]
        ("matmul_kernel", dict(a_ptr=P, b_ptr=P, c_ptr=P, M=i(W), N=i(H), K=i(N), stride_am=i(1), stride_ak=i(W),
                               stride_bk=i(H), stride_bn=i(1), stride_cm=i(H), stride_cn=i(1)),
         dict(mm, ACCUMULATE=False), t.warps),  # d_W[chunk] = dlogits.T @ hidden
        ("sparse_dh_kernel", dict(w_ptr=P, labels_ptr=L, ids_ptr=I, offsets_ptr=L, g_label_ptr=F, coef_ptr=F,
                                  dh_ptr=P, H=i(H), stride_w=i(H), stride_dh=i(H)),
         dict(gather, BLOCK_E=t.rows), headkernels.GATHER_WARPS),
        ("sparse_dw_kernel", dict(h_ptr=P, toks_ptr=L, coefs_ptr=F, starts_ptr=L, dw_ptr=P, H=i(H), stride_h=i(H),
                                  stride_dw=i(H)), dict(gather, BLOCK_R=t.rows), headkernels.GATHER_WARPS),
    ]


@pytest.mark.skipif(INTERPRET or not HAS_TRITON, reason="compiles, so not in the interpreter")
@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
def test_kernels_compile_for_sm90():
    """Catches what the interpreter lets through (tl.dot dims < 16, type errors in loops,
    shared memory) without a GPU: Triton compiles to a cubin for an H200 with its bundled ptxas."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    k, t = headkernels._triton(), headkernels.GPU_TILES
    for name, args, constexprs, warps in _sm90_jobs(t):
        fn = getattr(k, name)
        sig, attrs, consts = {}, {}, dict(constexprs)
        for arg in fn.arg_names:
            a = args.get(arg)
            if arg in constexprs or (isinstance(a, tuple) and a[1] == 1 and a[0] == "i32"):
                sig[arg], consts[arg] = "constexpr", consts.get(arg, 1)
            else:
                sig[arg] = a if isinstance(a, str) else a[0]
                if isinstance(a, str) or (a[0] == "i32" and a[1] % 16 == 0):
                    attrs[(fn.arg_names.index(arg),)] = [["tt.divisibility", 16]]
        src = triton.compiler.ASTSource(fn=fn, signature=sig, attrs=attrs,
                                        constexprs={(fn.arg_names.index(c),): v for c, v in consts.items()})
        c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": t.stages})
        assert c.metadata.shared <= 227 * 1024, (name, c.metadata.shared)
        assert ("wgmma" in c.asm["ptx"]) == (name in ("lse_kernel", "softmax_grad_kernel", "matmul_kernel")), name


# ----------------------------------------------------------------------------- GPU: the compiled kernels

def _zipf_kinds(N, seed):
    rng = np.random.default_rng(seed)
    return [["replayed", "draws", "empty"][i] for i in rng.choice(3, N, p=[0.6, 0.3, 0.1])]


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype,N,H,V", [(torch.bfloat16, 4000, 2048, 151936), (torch.float32, 500, 512, 32003)])
@pytest.mark.parametrize("gemm", ["triton", "torch"])
def test_gpu_matches_reference(dtype, N, H, V, gemm):
    """Compiled kernels in `dtype` against the reference on fp32 copies of the same values (the
    bf16 reference rounds its logits to bf16, the kernels do not). Forward to 1e-3 (bf16) /
    1e-4; gradients to a relative Frobenius error of 1e-2 (bf16: dlogits and the outputs are
    rounded once each) / 1e-4. N (and V in fp32) are not multiples of the tiles: masked edges.
    One shape per dtype keeps the compiles to one set each (bench/gpu.sh's time budget); the
    dense backward's GEMMs run both ways (head's backward_gemm)."""
    kinds = _zipf_kinds(N, seed=N)
    hidden, weight, labels, support = _problem(kinds, H=H, V=V, seed=1, dtype=dtype, device="cuda", pool=64, max_row=64)
    h32, w32 = (x.detach().float().requires_grad_() for x in (hidden, weight))
    cl, cs = _coefs(support.to("cpu"), N, torch.Generator().manual_seed(2), centered=True)
    fwd_tol, grad_tol = (1e-3, 1e-2) if dtype == torch.bfloat16 else (1e-4, 1e-4)
    for sparse in (False, True):
        out, (dh, dw) = _run(hidden, weight, labels, support, cl, cs, 0.8, "triton", sparse=sparse,
                             backward_gemm=gemm)
        ref, (rh, rw) = _run(h32, w32, labels, support, cl, cs, 0.8, "torch", sparse=sparse)
        for a, b in zip(out, ref):
            _close(a, b, atol=fwd_tol)
        assert dh.dtype == dw.dtype == dtype
        assert _rel(dh, rh) < grad_tol and _rel(dw, rw) < grad_tol, (sparse, _rel(dh, rh), _rel(dw, rw))


@pytest.mark.gpu
@gpu
def test_gpu_sparse_backward_is_bit_identical():
    kinds = _zipf_kinds(2048, seed=3)
    hidden, weight, labels, support = _problem(kinds, H=1024, V=32768, seed=4, dtype=torch.bfloat16, device="cuda",
                                               pool=16, max_row=64)
    cl, cs = _coefs(support.to("cpu"), 2048, torch.Generator().manual_seed(5), centered=True)
    runs = [_run(hidden, weight, labels, support, cl, cs, 1.0, "triton", sparse=True) for _ in range(2)]
    (f0, g0), (f1, g1) = runs
    assert all(torch.equal(a, b) for a, b in zip(f0 + g0, f1 + g1))


@pytest.mark.gpu
@gpu
def test_gpu_head_under_inductor():
    """The custom ops stay opaque to inductor: one graph, the eager values."""
    hidden, weight, labels, support = _problem(_zipf_kinds(512, seed=6), H=256, V=4096, seed=7,
                                               dtype=torch.bfloat16, device="cuda")

    def loss(hidden, weight, labels, support):
        logp, ent, slp = head(hidden, weight, labels, support, 0.7)  # impl="auto": Triton on CUDA
        return (logp * ent).sum() + slp.square().sum()

    ref = loss(hidden, weight, labels, support)
    out = torch.compile(loss, fullgraph=True)(hidden, weight, labels, support)
    torch.testing.assert_close(out, ref, atol=1e-3, rtol=1e-4)
