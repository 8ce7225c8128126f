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
import types
from pathlib import Path

import pytest
from safetensors import SafetensorError
from safetensors.torch import save as st_save

import checkpoint
import model as M
import start
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


# ----------------------------------------------------------------------------- a read-only or full disk mid-run

def _main(capsys, *args):
    """train.main in this process, read like a finished command: its exit status and its stderr."""
    capsys.readouterr()
    try:
        train.main([*SMALL, *args])
        code = 0
    except SystemExit as e:
        code = e.code
    said = capsys.readouterr()
    return types.SimpleNamespace(returncode=code, stdout=said.out, stderr=said.err)


def _same_but(before: dict, after: dict, *torn: str) -> None:
    """Every complete file written before the fault is unchanged; a `torn` one only grew (half a row)."""
    done = {k: v for k, v in before.items() if ".tmp" not in k and k not in torn}
    assert {k: after.get(k) for k in done} == done


def test_a_read_only_config_json_leaves_the_run_dir_as_it_was(finished, tmp_path, monkeypatch, capsys):
    """The first write of a run (config.json): a new --out-dir is gone again; on resume (config.json
    is rewritten) the run directory is byte-identical, and resumes once the disk is writable."""
    real = Path.write_text

    def read_only(self, *a, **k):
        if self.name.startswith("config.json"):
            raise OSError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "write_text", read_only)
    new = tmp_path / "new"
    one_line(_main(capsys, "--steps", "1", "--out-dir", str(new)), 1, "cannot write", os.strerror(errno.EACCES))
    assert not new.exists()
    out = _copy(finished, tmp_path)
    before = _tree(out)
    one_line(_main(capsys, "--steps", "3", "--resume", "--out-dir", str(out)), 1, "cannot write", str(out),
             os.strerror(errno.EACCES), "config.json")
    assert _tree(out) == before
    monkeypatch.undo()
    assert _main(capsys, "--steps", "3", "--resume", "--out-dir", str(out)).returncode == 0
    assert [r["step"] for r in _rows(out)] == [1, 2, 3]


def test_a_full_disk_mid_metrics_row_keeps_what_was_written(tmp_path, monkeypatch, capsys):
    """Step 2's row: half of it lands, then ENOSPC. Step 1's row and checkpoint stay, and --resume
    drops the torn row and continues from step_000001."""
    out, seen, rows_before = tmp_path / "run", {}, []
    real_open = open

    def full_at_row_2(path, mode="r", *a, **k):
        f = real_open(path, mode, *a, **k)
        if Path(path).name == "metrics.jsonl" and "a" in mode:
            write, rows = f.write, []

            def torn(text):
                rows.append(text)
                if len(rows) < 2:
                    return write(text)
                seen.update(_tree(out))
                rows_before.append((out / "metrics.jsonl").read_bytes())
                write(text[: len(text) // 2])
                f.flush()
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

            f.write = torn
        return f

    monkeypatch.setattr(checkpoint, "open", full_at_row_2, raising=False)  # shadows the builtin in checkpoint.py
    one_line(_main(capsys, "--steps", "3", "--save-every", "1", "--out-dir", str(out)), 1, "cannot write",
             os.strerror(errno.ENOSPC), "metrics.jsonl")
    _same_but(seen, _tree(out), "metrics.jsonl")
    assert (out / "metrics.jsonl").read_bytes().startswith(rows_before[0])  # step 1's row, then half of step 2's
    assert [p.name for p in checkpoint.checkpoints(out)] == ["step_000001"]
    monkeypatch.undo()
    r = _main(capsys, "--steps", "3", "--resume", "--out-dir", str(out))
    assert r.returncode == 0 and "dropping its torn last row" in r.stdout
    assert [r["step"] for r in _rows(out)] == [1, 2, 3]


@pytest.mark.parametrize("raised", ["OSError", "SafetensorError"])
def test_a_full_disk_mid_checkpoint_never_shows_a_torn_step_dir(tmp_path, monkeypatch, capsys, raised):
    """step_000002's weights: half the file lands under step_000002.tmp, then ENOSPC (as an OSError,
    or as safetensors' own writer reports it). No step_000002 appears (the torn copy is removed),
    `final` still names step_000001, and --resume continues from it."""
    out, seen, calls = tmp_path / "run", {}, []
    real = M.save_file

    def full_at_save_2(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) < 2:
            return real(tensors, filename, metadata=metadata)
        seen.update(_tree(out))
        Path(filename).write_bytes(st_save(tensors)[:1000])
        if raised == "SafetensorError":  # what safetensors 0.8's save_file raised on a full disk
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), filename)

    monkeypatch.setattr(M, "save_file", full_at_save_2)
    one_line(_main(capsys, "--steps", "3", "--save-every", "1", "--out-dir", str(out)), 1, "cannot write",
             os.strerror(errno.ENOSPC), "step_000002.tmp")
    _same_but(seen, _tree(out))
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "final", "metrics.jsonl", "step_000001"]
    assert os.readlink(out / "final") == "step_000001"
    assert [r["step"] for r in _rows(out)] == [1, 2]  # step 2's row was written before its checkpoint
    monkeypatch.undo()
    assert _main(capsys, "--steps", "3", "--resume", "--out-dir", str(out)).returncode == 0
    assert [r["step"] for r in _rows(out)] == [1, 2, 3] and os.readlink(out / "final") == "step_000003"


# ----------------------------------------------------------------------------- an engine that will not start

@pytest.mark.parametrize("model", ["default", "scratch"])
def test_an_engine_that_fails_to_start_leaves_the_run_dir_as_it_was(tmp_path, monkeypatch, capsys, model):
    """config.json is written once the engine started; `--model scratch` writes its model into
    out/scratch before (the engine loads a directory), and a failed start takes it back."""
    flags = ["--steps", "1", "--max-new-tokens", "4"] + (["--model", "scratch"] if model == "scratch" else [])

    def refuses(*a, **k):
        raise ValueError("--engine torch: refuses this flag")

    monkeypatch.setattr(start, "make_engine", refuses)
    new = tmp_path / "runs" / "new"
    one_line(_main(capsys, *flags, "--out-dir", str(new)), 2, "refuses this flag")
    assert not (tmp_path / "runs").exists()  # and the parent this start would have made
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    one_line(_main(capsys, *flags, "--out-dir", str(mine)), 2, "refuses this flag")
    assert _tree(mine) == {"notes.txt": hashlib.sha256(b"mine").hexdigest()}
    monkeypatch.undo()
    for out in (new, mine):
        assert _main(capsys, *flags, "--out-dir", str(out)).returncode == 0
        assert [r["step"] for r in _rows(out)] == [1]
