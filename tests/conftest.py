"""Tests run from the repo root (`python -m pytest -q`); the flat modules import as top level."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


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
