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


@pytest.mark.parametrize("args,words", [
    (["--lr", "inf"], "--lr must be a finite number"),
    (["--adv-tau", "inf"], "--adv-tau must be a finite number"),
    (["--kl-coeff", "inf"], "--kl-coeff must be a finite number"),
    (["--temperature", "inf"], "--temperature must be a finite number"),
    (["--weight-decay", "nan"], "--weight-decay must be a finite number"),
    (["--stage", "sft", "--loss", "ppo"], "--loss ppo has no effect with --stage sft"),
    (["--epochs", "2", "--loss", "reinforce"], "--epochs 2 with plain reinforce"),
    (["--epochs", "2", "--correction-metrics-only"], "--epochs 2 with plain reinforce"),
    (["--task", "nope"], "--task must be reverse-text, arithmetic or jsonl:PATH"),
    (["--eval-file", "x.jsonl"], "--eval-file is for --task jsonl:PATH"),
    (["--chat-template-kwargs", "[1]"], "--chat-template-kwargs must be a JSON object"),
])
def test_flags_without_a_finite_value_or_an_effect_are_refused(args, words, capsys):
    with pytest.raises(SystemExit) as e:
        C.parse(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and words in err[0], err


def test_caps_whose_inf_means_no_cap_stay_accepted():
    cfg = C.parse(["--tis-cap", "inf", "--grad-clip", "inf", "--max-importance-ratio", "inf"])
    assert cfg.tis_cap == cfg.grad_clip == float("inf")
    C.parse(["--epochs", "2", "--loss", "icepop"])  # p/q-weighted: allowed, with a note at start-up
