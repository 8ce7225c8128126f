"""bench/phases.py's rule for compiled code, on real profiles: a small function compiled (Inductor's kernel
profiling on, as the script turns it on under --compile on) and the same function eager."""

import torch
from torch.profiler import ProfilerActivity, profile

from conftest import bench_module

phases = bench_module("phases")


def _f(x, w):
    return (torch.relu(x @ w) * 2 + 1).sum()


def _profiled(fn, x, w):
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn(x, w).backward()
    return prof.events()


def test_the_ops_of_a_compiled_graph_are_told_from_eager_ones():
    x, w = torch.randn(16, 16, requires_grad=True), torch.randn(16, 16, requires_grad=True)
    g = torch.compile(_f, dynamic=False)
    with torch._inductor.config.patch({"cpp.enable_kernel_profile": True}):
        g(x, w).backward()  # compiles the forward and the backward graph
        compiled = _profiled(g, x, w)
    eager = _profiled(_f, x, w)

    kinds = [(e.name, phases.kind(e)) for e in compiled]
    # the matmuls (extern kernels: two in the backward, one in the forward) run inside Inductor's graph calls
    assert [k for n, k in kinds if n == "aten::mm"] == ["compiled"] * 3
    assert sum(k == "kernel" for _, k in kinds) >= 2  # a fused kernel in the forward graph and one in the backward
    # relu, mul, add and sum are fused: none of them runs as an aten operator, eager or compiled
    assert not {n for n, _ in kinds} & {"aten::relu", "aten::mul", "aten::add", "aten::sum"}
    s = phases.split(compiled)
    assert s["compiled"] > 0 and s["kernel"] > 0

    assert {phases.kind(e) for e in eager if e.name.startswith("aten::")} == {"eager"}
    assert not any(phases.in_graph(e) or phases.kind(e) == "kernel" for e in eager)
    s = phases.split(eager)
    assert s["eager"] > 0 and s["compiled"] == s["kernel"] == 0


def test_compile_on_reads_both_spellings():
    assert phases.compile_on(["--steps", "2", "--compile", "on"]) and phases.compile_on(["--compile=on"])
    assert not phases.compile_on(["--compile", "off"]) and not phases.compile_on(["--steps", "2"])
