"""Tests run from the repo root (`python -m pytest -q`); the flat modules import as top level."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
