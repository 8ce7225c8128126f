"""Faults from the command line: each bad start gets one line and exit 2 and leaves the run
directory exactly as it was (hashed before and after); damaged state is named and worked
around, never a traceback. (Reward outages and non-finite steps: tests/test_inputs.py.)"""

import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import checkpoint
import train
from conftest import one_line

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "6", "--eval-every", "0"]


def _tree(d: Path) -> dict:
    """Every file under d (symlinks as their target) -> its sha256."""
    out = {}
    for p in sorted(d.rglob("*")):
        if p.is_symlink():
            out[str(p.relative_to(d))] = "-> " + os.readlink(p)
        elif p.is_file():
            out[str(p.relative_to(d))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _cli(*args, timeout=180):
    return subprocess.run([sys.executable, str(ROOT / "train.py"), *SMALL, *args], capture_output=True, text=True,
                          timeout=timeout)



@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished 2-step run with checkpoints at both steps."""
    out = tmp_path_factory.mktemp("faults") / "run"
    train.main(["--steps", "2", "--save-every", "1", "--out-dir", str(out), *SMALL])
    return out


def test_a_new_run_into_a_finished_one_is_refused_and_changes_nothing(finished, tmp_path):
    out = _copy(finished, tmp_path)
    before = _tree(out)
    r = _cli("--steps", "2", "--out-dir", str(out))
    one_line(r, 2, str(out), "holds a run already", "--resume")
    for bad in (["--weight-decay", "nan"], ["--lr", "inf"],
                ["--task", "jsonl:" + str(out / "none.jsonl"), "--reward", "numeric_match"]):
        one_line(_cli("--steps", "3", "--resume", "--out-dir", str(out), *bad), 2)
    assert _tree(out) == before


def test_a_failed_start_writes_nothing(tmp_path):
    out = tmp_path / "run"
    for bad in (["--model", str(tmp_path / "missing")], ["--weight-decay", "nan"], ["--temperature", "inf"],
                ["--model", "scratch", "--eval-prompts", "300", "--max-words", "1"]):
        r = _cli("--steps", "1", "--out-dir", str(out), *bad)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert not out.exists(), bad


def test_an_out_dir_that_is_a_file_isone_line(tmp_path):
    f = tmp_path / "file"
    f.write_text("mine")
    one_line(_cli("--steps", "1", "--out-dir", str(f)), 2, "is a file")
    assert f.read_text() == "mine"


def _copy(finished: Path, tmp_path: Path) -> Path:
    out = tmp_path / "run"
    subprocess.run(["cp", "-a", str(finished), str(out)], check=True)
    return out


def _rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_torn_last_metrics_row_is_dropped_with_a_warning(finished, tmp_path, capsys):
    out = _copy(finished, tmp_path)
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "loss": 0.1')  # a full disk mid-row
    train.main(["--steps", "3", "--resume", "--out-dir", str(out), *SMALL])
    assert "dropping its torn last row" in capsys.readouterr().out
    assert [r["step"] for r in _rows(out)] == [1, 2, 3]


def test_a_bad_row_in_the_middle_is_refused(finished, tmp_path):
    out = _copy(finished, tmp_path)
    lines = (out / "metrics.jsonl").read_text().splitlines()
    (out / "metrics.jsonl").write_text("{oops\n" + "\n".join(lines[1:]) + "\n")
    before = _tree(out)
    one_line(_cli("--steps", "3", "--resume", "--out-dir", str(out)), 2, "metrics.jsonl:1 is not valid JSON")
    assert _tree(out) == before


@pytest.mark.parametrize("damage", ["state", "optimizer", "weights"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(finished, tmp_path, capsys, damage):
    out = _copy(finished, tmp_path)
    newest = out / "step_000002"
    if damage == "state":
        (newest / "trainer_state" / "state.json").write_text('{"step": 2, "python_rng"')
    else:
        f = newest / ("trainer_state/optim_rng.safetensors" if damage == "optimizer" else "model.safetensors")
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    train.main(["--steps", "3", "--resume", "--out-dir", str(out), *SMALL])
    said = capsys.readouterr().out
    assert "step_000002 is damaged" in said and "resuming from step_000001" in said
    clean = tmp_path / "clean"
    train.main(["--steps", "3", "--out-dir", str(clean), *SMALL])

    def strip(rows):
        return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]

    assert strip(_rows(out)) == strip(_rows(clean))  # from step 1 on, the run is the uninterrupted one


def test_every_checkpoint_damaged_isone_line(finished, tmp_path):
    out = _copy(finished, tmp_path)
    for p in out.glob("step_*/trainer_state/state.json"):
        p.write_text("{")
    one_line(_cli("--steps", "3", "--resume", "--out-dir", str(out)), 2, "every checkpoint", "damaged")


def test_the_logger_never_empties_the_history(finished, tmp_path, monkeypatch):
    """The kept rows go to a temporary file renamed over metrics.jsonl: a failure while writing it
    (here a full disk) leaves the old history whole."""
    out = _copy(finished, tmp_path)
    before = (out / "metrics.jsonl").read_bytes()
    real = Path.write_text

    def full_disk(self, *a, **k):
        if self.name == "metrics.jsonl.tmp":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "write_text", full_disk)
    with pytest.raises(SystemExit) as e:
        train.main(["--steps", "3", "--resume", "--out-dir", str(out), *SMALL])
    assert e.value.code == 1 and (out / "metrics.jsonl").read_bytes() == before


def test_damage_reads_headers_only(finished):
    assert checkpoint.damage(finished / "step_000002") is None


def test_a_tokenizer_larger_than_the_vocabulary_is_one_line(tmp_path):
    d = tmp_path / "model"
    subprocess.run(["cp", "-a", str(ROOT / "checkpoints" / "reverse-tiny"), str(d)], check=True)
    shutil.copy(ROOT / "checkpoints" / "arith-tiny" / "tokenizer.json", d / "tokenizer.json")  # 45 tokens, vocab 32
    out = tmp_path / "run"
    one_line(_cli("--steps", "1", "--model", str(d), "--out-dir", str(out)), 2, "tokenizer.json has 45 tokens",
             "vocab_size 32")
    assert not out.exists()
