"""Bad flag values stop the program with one line naming the flag, and exit status 2."""

import subprocess
import sys
from pathlib import Path

import pytest

import config as C

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("args,flag", [
    (["--icepop-alpha", "3", "--icepop-beta", "2"], "--icepop-alpha/--icepop-beta"),
    (["--top-p", "1.5"], "--top-p"),
    (["--temperature", "0"], "--temperature"),
    (["--steps", "-1"], "--steps"),
])
def test_bad_flag_exits_2_with_one_line(args, flag, tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), *args, "--out-dir", str(tmp_path / "run")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0], r.stderr
    assert not (tmp_path / "run").exists()  # stopped before any work


def test_defaults_are_valid_and_resolve():
    cfg = C.parse([]).resolve(cuda_available=False)
    assert (cfg.device, cfg.compile, cfg.loss) == ("cpu", "off", "icepop")
    assert cfg.lr > 0
