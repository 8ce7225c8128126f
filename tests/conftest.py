"""Tests run from the repo root (`python -m pytest -q`); the flat modules import as top level."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def one_line(r, code: int, *words: str) -> None:
    """A finished train.py process stopped with exit status `code` and one stderr line holding `words`."""
    assert r.returncode == code, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    for w in words:
        assert w in lines[0], lines[0]
