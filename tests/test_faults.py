"""Faults from the command line: each bad start gets one line and exit 2 and leaves the run
directory exactly as it was (hashed before and after); damaged state is named and worked
around, never a traceback. (Reward outages and non-finite steps: tests/test_inputs.py.)"""

import errno
import hashlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from run import checkpoint
import config as C
from run import rundir
from run import runlog
from run import hfdir
from run import shardfiles
from run import start
import train
from conftest import one_line

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "6", "--eval-every", "0"]


def _tree(d: Path) -> dict:
    """Every file under d (symlinks as their target) -> its sha256; a live run's empty `.lock` aside."""
    out = {}
    for p in sorted(d.rglob("*")):
        if p.name == ".lock":
            continue
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
        f = newest / ("trainer_state/optim_rng-00000-of-00001.safetensors" if damage == "optimizer" else "model.safetensors")
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
    _refuse(monkeypatch, "metrics.jsonl.tmp", errno.ENOSPC, at="write")
    with pytest.raises(SystemExit) as e:
        train.main(["--steps", "3", "--resume", "--out-dir", str(out), *SMALL])
    assert e.value.code == 1 and (out / "metrics.jsonl").read_bytes() == before


def _refuse(monkeypatch, name: str, code: int, at: str = "open") -> None:
    """create_new fails for the file `name` with OSError `code`: at its creation (a read-only
    directory), or at its first write (a full disk). Patched where it is defined and in runlog, which
    imports it by name."""
    real = rundir.create_new

    def failing(path):
        if path.name != name:
            return real(path)
        if at == "open":
            raise OSError(code, os.strerror(code), str(path))
        f = real(path)

        def write(text):
            raise OSError(code, os.strerror(code), str(path))

        f.write = write
        return f

    monkeypatch.setattr(rundir, "create_new", failing)
    monkeypatch.setattr(runlog, "create_new", failing)


def test_damage_passes_a_whole_checkpoint(finished):
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
    _refuse(monkeypatch, "config.json.tmp", errno.EACCES)
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
        if Path(path).name == "metrics.jsonl.tmp":  # the Logger's file, renamed to metrics.jsonl
            write, rows = f.write, []

            def torn(text):
                if not text:  # a new run's kept rows: none
                    return write(text)
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

    monkeypatch.setattr(rundir, "open", full_at_row_2, raising=False)  # shadows the builtin in run/rundir.py (create_new)
    one_line(_main(capsys, "--steps", "3", "--save-every", "1", "--out-dir", str(out)), 1, "cannot write",
             os.strerror(errno.ENOSPC), "metrics.jsonl")
    _same_but(seen, _tree(out), "metrics.jsonl")
    assert (out / "metrics.jsonl").read_bytes().startswith(rows_before[0])  # step 1's row, then half of step 2's
    assert [p.name for p in rundir.checkpoints(out)] == ["step_000001"]
    monkeypatch.undo()
    r = _main(capsys, "--steps", "3", "--resume", "--out-dir", str(out))
    assert r.returncode == 0 and "dropping its torn last row" in r.stdout
    assert [r["step"] for r in _rows(out)] == [1, 2, 3]


def test_a_full_disk_mid_checkpoint_never_shows_a_torn_step_dir(tmp_path, monkeypatch, capsys):
    """step_000002's weights: part of the file lands under step_000002.tmp, then ENOSPC. No
    step_000002 appears (the torn copy is removed), `final` still names step_000001, and --resume
    continues from it."""
    out, seen, calls = tmp_path / "run", {}, []
    real = shardfiles.Stream.add

    def full_at_save_2(self, t):
        if self.path.name == "model.safetensors" and self.n == 0:
            calls.append(self.path)
        if len(calls) < 2:
            return real(self, t)
        seen.update(_tree(out))
        self.f.write(b"x" * 1000)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))

    monkeypatch.setattr(shardfiles.Stream, "add", full_at_save_2)
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
    one_line(_main(capsys, *flags, "--out-dir", str(mine)), 2, "refuses this flag")
    assert list(mine.iterdir()) == []  # the lock too is gone
    monkeypatch.undo()
    for out in (new, mine):
        assert _main(capsys, *flags, "--out-dir", str(out)).returncode == 0
        assert [r["step"] for r in _rows(out)] == [1]


# ----------------------------------------------------------------------------- what a run directory is, and its lock

def test_a_directory_that_is_not_a_run_is_refused_and_left_as_it_was(tmp_path, capsys):
    """A model directory as --out-dir (its config.json was overwritten), a directory with a config.json
    of something else or any other file, and an --out-dir inside the --model directory: one line,
    nothing written."""
    model = tmp_path / "M"
    subprocess.run(["cp", "-a", str(ROOT / "checkpoints" / "reverse-tiny"), str(model)], check=True)
    other, notes = tmp_path / "other", tmp_path / "notes"
    other.mkdir()
    (other / "config.json").write_text('{"name": "not a run"}')
    notes.mkdir()
    (notes / "notes.txt").write_text("mine")
    before = {d: _tree(d) for d in (model, other, notes)}
    for out, words in ((model, "is the --model directory"), (model / "run", "is the --model directory"),
                       (other, "holds no floe run"), (notes, "notes.txt")):
        one_line(_main(capsys, "--steps", "1", "--model", str(model), "--out-dir", str(out)), 2, str(out), *words)
    assert {d: _tree(d) for d in before} == before


_HOLDER = """
import sys, time
sys.path.insert(0, {root!r})
from run import rundir
from pathlib import Path
lock = rundir.RunLock(Path(sys.argv[1]))
print("locked", flush=True)
time.sleep(120)
"""


def test_a_locked_directory_is_one_line_and_a_killed_holder_leaves_no_lock(finished, tmp_path, capsys):
    """A second run into a directory another process holds: one line naming it, nothing changed.
    SIGKILL the holder and the kernel drops its flock: the run goes on."""
    out = _copy(finished, tmp_path)
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER.format(root=str(ROOT)), str(out)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = _tree(out)
        one_line(_main(capsys, "--steps", "3", "--resume", "--out-dir", str(out)), 2, str(out),
                 "in use by another run")
        assert _tree(out) == before
    finally:
        holder.kill()
        holder.wait()
    assert _main(capsys, "--steps", "3", "--resume", "--out-dir", str(out)).returncode == 0
    assert [r["step"] for r in _rows(out)] == [1, 2, 3] and not (out / ".lock").exists()


def test_a_planted_lock_symlink_is_never_followed(finished, tmp_path, capsys):
    out, victim = _copy(finished, tmp_path), tmp_path / "victim"
    victim.write_text("victim")
    (out / ".lock").symlink_to(victim)
    one_line(_main(capsys, "--steps", "3", "--resume", "--out-dir", str(out)), 2, "cannot lock", ".lock")
    assert victim.read_text() == "victim" and (out / ".lock").is_symlink()


def test_a_run_holds_its_lock_while_it_runs(tmp_path, monkeypatch, capsys):
    """At step 1 a second taker of the directory is refused (flock conflicts between open files, in
    one process too); two runs started at once therefore cannot both write it."""
    out, tried = tmp_path / "run", []
    real = train.rl_step

    def step(run, n, ahead=None):
        with pytest.raises(C.ConfigError, match="in use by another run"):
            rundir.RunLock(out.absolute())
        tried.append(n)
        return real(run, n, ahead)

    monkeypatch.setattr(train, "rl_step", step)
    assert _main(capsys, "--steps", "1", "--out-dir", str(out)).returncode == 0 and tried == [1]


def test_a_run_directory_that_changed_while_the_start_checked_it_is_one_line(tmp_path, monkeypatch, capsys):
    """The checks run before the lock is taken: a run that came and went in between (here: a file
    that appears) is caught once the lock is held, and nothing is written."""
    out = tmp_path / "run"
    real = rundir.RunLock

    def late(path):
        (path / "config.json").write_text("{}")  # another start got there first
        return real(path)

    monkeypatch.setattr(rundir, "RunLock", late)
    one_line(_main(capsys, "--steps", "1", "--out-dir", str(out)), 2, "changed while this run was starting")
    assert not out.exists()


# ----------------------------------------------------------------------------- nothing written through a planted link

def test_create_new_never_follows_a_planted_symlink(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("victim")
    (tmp_path / "x.tmp").symlink_to(victim)
    rundir.write_file(tmp_path / "x", "mine")
    assert victim.read_text() == "victim" and (tmp_path / "x").read_text() == "mine"
    assert not (tmp_path / "x").is_symlink() and not (tmp_path / "x.tmp").exists()


def test_planted_symlinks_in_a_run_directory_are_never_followed(finished, tmp_path, monkeypatch, capsys):
    """Every temporary name a resume writes (metrics.jsonl.tmp, config.json.tmp, final.tmp, the
    checkpoint's step_000003.tmp, wandb_id) planted as a symlink: the targets stay as they were and
    what lands in the run is floe's own regular files."""
    out = _copy(finished, tmp_path)
    victims = tmp_path / "victims"
    (victims / "dir").mkdir(parents=True)
    planted = {"metrics.jsonl.tmp": "m", "config.json.tmp": "c", "final.tmp": "f", "wandb_id": "w"}
    for name, v in planted.items():
        (victims / v).write_text("victim")
        (out / name).symlink_to(victims / v)
    (out / "step_000003.tmp").symlink_to(victims / "dir", target_is_directory=True)
    ids = []
    fake = types.SimpleNamespace(init=lambda **k: ids.append(k["id"]) or types.SimpleNamespace(
        log=lambda *a, **k: None, finish=lambda: None))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    assert _main(capsys, "--steps", "3", "--resume", "--wandb-project", "p", "--out-dir", str(out)).returncode == 0
    assert _tree(victims) == {"c": hashlib.sha256(b"victim").hexdigest(), **{
        v: hashlib.sha256(b"victim").hexdigest() for v in ("m", "f", "w")}}
    for name in ("metrics.jsonl", "config.json", "wandb_id"):
        assert not (out / name).is_symlink() and (out / name).is_file(), name
    assert ids and ids[0] != "victim" and (out / "wandb_id").read_text() == ids[0]
    assert [r["step"] for r in _rows(out)] == [1, 2, 3] and os.readlink(out / "final") == "step_000003"
    assert (out / "step_000003").is_dir() and not (out / "step_000003").is_symlink()
    assert not any(p.name.endswith(".tmp") for p in out.iterdir())


def test_a_new_run_into_a_directory_with_a_planted_symlink_is_refused(tmp_path, capsys):
    victim, d = tmp_path / "victim", tmp_path / "d"
    victim.write_text("victim")
    d.mkdir()
    (d / "metrics.jsonl.tmp").symlink_to(victim)
    one_line(_main(capsys, "--steps", "1", "--out-dir", str(d)), 2, "holds no floe run")
    assert victim.read_text() == "victim" and os.readlink(d / "metrics.jsonl.tmp") == str(victim)


# ----------------------------------------------------------------------------- a resume's record, and nothing to do

def test_a_resume_keeps_the_runs_record(finished, tmp_path, capsys):
    """config.json keeps what the run was trained from (--model, --out-dir as first given); only the
    flags a resume may change follow it (--steps here, and --save-every back to its default)."""
    out = _copy(finished, tmp_path)
    saved = json.loads((out / "config.json").read_text())
    r = _main(capsys, "--steps", "3", "--resume", "--model", "/nonexistent", "--out-dir", str(out) + "/.")
    assert r.returncode == 0 and "--model /nonexistent is not used" in r.stdout
    assert json.loads((out / "config.json").read_text()) == {**saved, "steps": 3, "save_every": 0}


@pytest.mark.parametrize("steps", ["2", "1"])
def test_a_resume_with_nothing_to_do_says_so_and_changes_nothing(finished, tmp_path, capsys, steps):
    out = _copy(finished, tmp_path)
    before = _tree(out)
    r = _main(capsys, "--steps", steps, "--resume", "--out-dir", str(out))
    assert r.returncode == 0 and not r.stderr
    assert r.stdout.strip() == (f"floe: nothing to do: the run in {out} is at step 2 and --steps is {steps}; "
                                "give --steps above 2 to continue it")
    assert _tree(out) == before


# ----------------------------------------------------------------------------- checkpoints that fall back

@pytest.fixture(scope="module")
def clean3(finished) -> list[dict]:
    """The uninterrupted 3-step run's rows (time/* aside): what every resume of `finished` must give."""
    out = finished.parent / "clean3"
    train.main(["--steps", "3", "--out-dir", str(out), *SMALL])
    return _strip(_rows(out))


def _strip(rows):
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]


def _optim(path: Path, edit) -> None:
    f = path / "trainer_state" / "optim_rng-00000-of-00001.safetensors"
    tensors = st_load(f.read_bytes())
    edit(tensors)
    f.write_bytes(st_save(tensors))


def _state(path: Path, **changes) -> None:
    f = path / "trainer_state" / "state.json"
    f.write_text(json.dumps({**json.loads(f.read_text()), **changes}))


DAMAGE = {  # a part of the newest checkpoint, damaged: what the warning names
    "step": (lambda p: _state(p, step=5), "says step 5, its directory is step_000002"),
    "python_rng": (lambda p: _state(p, python_rng=[3, [1, 2], None]), "ValueError"),
    "optim_key": (lambda p: _optim(p, lambda t: t.update({"optim/nope.weight/exp_avg": torch.zeros(2)})),
                  "optim/nope.weight/exp_avg is no optimizer state"),
    "optim_shape": (lambda p: _optim(p, lambda t: t.update({k: torch.zeros(3) for k in t if k.endswith("/exp_avg")})),
                    "has shape (3,)"),
    "config": (lambda p: (p / "config.json").unlink(), "config.json: missing"),
    "tokenizer": (lambda p: (p / "tokenizer.json").unlink(), "tokenizer.json: missing"),
    "nan": (lambda p: (p / "model.safetensors").write_bytes(st_save({k: v.fill_(math.nan) if k.endswith("norm.weight")
                                                                      else v for k, v in
                                                                      st_load((p / "model.safetensors").read_bytes()).items()})),
            "holds NaN or inf"),
}


@pytest.mark.parametrize("part", DAMAGE)
def test_a_damaged_part_of_the_newest_checkpoint_falls_back(finished, tmp_path, capsys, part):
    """Each part a resume reads, damaged in step_000002: the start picks step_000001, warning with the
    cause (the full resume from a fallback: test_a_damaged_newest_checkpoint_falls_back_to_the_one_before)."""
    out = _copy(finished, tmp_path)
    spoil, words = DAMAGE[part]
    spoil(out / "step_000002")
    assert checkpoint.damage(out / "step_000002") is not None
    capsys.readouterr()
    s = start.check_start(C.parse(["--steps", "3", "--resume", "--out-dir", str(out), *SMALL]).resolve(False))
    said = capsys.readouterr().out
    assert s.resume_from.name == "step_000001" and [r["step"] for r in s.kept] == [1]
    assert "step_000002 is damaged" in said and words in said, said


def test_a_checkpoint_whose_rows_were_lost_falls_back_and_redoes_them(finished, tmp_path, clean3, capsys):
    """The last row torn (a power cut), its step's checkpoint whole: resuming there would never redo the
    row, so the resume starts from the checkpoint before it, and the rows come out whole."""
    out = _copy(finished, tmp_path)
    text = (out / "metrics.jsonl").read_text()
    (out / "metrics.jsonl").write_text(text[: text.rindex('"step": 2') + 12])
    r = _main(capsys, "--steps", "3", "--resume", "--out-dir", str(out))
    assert r.returncode == 0 and "lacks the row of step 2, which step_000002 covers" in r.stdout
    assert _strip(_rows(out)) == clean3


def test_rows_are_on_disk_before_the_checkpoint_that_covers_them(tmp_path, monkeypatch, capsys):
    out, events = tmp_path / "run", []
    real_fsync, real_save = os.fsync, hfdir.save

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"), os.fstat(fd).st_size))
        return real_fsync(fd)

    def save(model, path, *a, **k):
        events.append(("save", Path(path).name, (out / "metrics.jsonl").stat().st_size))
        return real_save(model, path, *a, **k)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(hfdir, "save", save)
    assert _main(capsys, "--steps", "2", "--save-every", "1", "--out-dir", str(out)).returncode == 0
    metrics = str((out / "metrics.jsonl").absolute())
    for i, e in enumerate(events):
        if e[0] == "save":
            synced = [f for f in events[:i] if f[0] == "fsync" and f[1] == metrics]
            assert synced and synced[-1][2] == e[2], (e, events[:i])  # every row so far, fsynced


@pytest.mark.parametrize("line", ["42", '{"step": "x"}', '{"loss": 1.0}'])
def test_a_metrics_line_that_is_not_a_row_is_one_line(finished, tmp_path, line):
    out = _copy(finished, tmp_path)
    rows = (out / "metrics.jsonl").read_text().splitlines()
    (out / "metrics.jsonl").write_text(line + "\n" + "\n".join(rows[1:]) + "\n")
    before = _tree(out)
    one_line(_cli("--steps", "3", "--resume", "--out-dir", str(out)), 2, "metrics.jsonl:1 is not a metrics row")
    assert _tree(out) == before


# ----------------------------------------------------------------------------- Ctrl-C, and runs that stopped early

def _stop_at(monkeypatch, at: int, exc) -> None:
    real = train.rl_step

    def step(run, n, ahead=None):
        if n == at:
            raise exc
        return real(run, n, ahead)

    monkeypatch.setattr(train, "rl_step", step)


def test_ctrl_c_is_one_line_naming_where_resume_goes_on(tmp_path, monkeypatch, clean3, capsys):
    """Ctrl-C at step 3: one line (no traceback), exit 130, and --resume goes on exactly."""
    out = tmp_path / "run"
    _stop_at(monkeypatch, 3, KeyboardInterrupt())
    r = _main(capsys, "--steps", "3", "--save-every", "1", "--out-dir", str(out))
    assert r.returncode == 130 and r.stderr.strip() == "floe: interrupted at step 3; --resume continues from step 2"
    _stop_at(monkeypatch, 1, KeyboardInterrupt())
    r = _main(capsys, "--steps", "3", "--out-dir", str(tmp_path / "early"))
    assert r.stderr.strip() == "floe: interrupted at step 1; no checkpoint yet: run it again without --resume to start over"
    monkeypatch.undo()
    r = _main(capsys, "--steps", "3", "--resume", "--out-dir", str(out))
    assert r.returncode == 0 and _strip(_rows(out)) == clean3


def _sigint_default():
    """A child started by a runner that ignores SIGINT (a shell's `&` job) would inherit SIG_IGN, and
    Python installs its KeyboardInterrupt handler only over the default."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_a_real_sigint_is_one_line_and_exit_130(tmp_path):
    out = tmp_path / "run"
    p = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *SMALL, "--steps", "200", "--save-every", "1",
                          "--out-dir", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         preexec_fn=_sigint_default)
    try:
        deadline = time.monotonic() + 120
        while not (out / "step_000001").is_dir() and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.2)
        p.send_signal(signal.SIGINT)
        err = p.communicate(timeout=60)[1]
    finally:
        p.kill()
    assert p.returncode == 130 and len(err.strip().splitlines()) == 1, err
    assert re.fullmatch(r"floe: interrupted at step \d+; --resume continues from step \d+", err.strip()), err


def test_a_sigint_while_the_rollout_thread_waits_on_a_hung_reward_exits_at_once(tmp_path):
    """--async-level 1, a reward that never returns from its second call, --call-timeout 600: Ctrl-C
    while the thread waits on it sets the run's stop event, the call is abandoned, and the run exits
    with its one line in seconds, not after the call's timeout."""
    out, hung = tmp_path / "run", tmp_path / "hung"
    (tmp_path / "slow.py").write_text(
        "import pathlib, time\nfrom tasks.rewards import similarity\ncalls = 0\n"
        "def score(prompts, completions, target, **kwargs):\n    global calls\n    calls += 1\n"
        f"    if calls >= 2:\n        pathlib.Path({str(hung)!r}).touch()\n        time.sleep(3600)\n"
        "    return similarity(prompts, completions, target)\n")
    p = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *SMALL, "--steps", "5", "--async-level", "1",
                          "--reward", f"{tmp_path / 'slow.py'}:score", "--call-timeout", "600", "--out-dir", str(out)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, preexec_fn=_sigint_default)
    try:
        deadline = time.monotonic() + 120
        while not hung.exists() and time.monotonic() < deadline and p.poll() is None:
            time.sleep(0.2)
        assert hung.exists(), "the reward was never called a second time"
        t0 = time.monotonic()
        p.send_signal(signal.SIGINT)
        err = p.communicate(timeout=60)[1]
        took = time.monotonic() - t0
    finally:
        p.kill()
    assert p.returncode == 130 and re.fullmatch(r"floe: interrupted at step \d+; .*", err.strip()), err
    assert took < 30, f"the exit waited {took:.0f} s on the hung reward"


def test_a_run_that_stopped_before_its_first_step_is_started_over(tmp_path, monkeypatch, capsys):
    """A failure at step 1 (here a prompt that cannot fit) leaves config.json and an empty metrics.jsonl:
    --resume says how to start over, and the same command again starts it over, saying so."""
    out = tmp_path / "run"
    _stop_at(monkeypatch, 1, train.RunError("every prompt is longer than the context"))
    one_line(_main(capsys, "--steps", "2", "--out-dir", str(out)), 1, "longer than the context")
    assert (out / "config.json").is_file() and (out / "metrics.jsonl").read_text() == ""
    monkeypatch.undo()
    one_line(_main(capsys, "--steps", "2", "--resume", "--out-dir", str(out)), 2, "no complete checkpoint",
             "stopped before its first step", "without --resume")
    r = _main(capsys, "--steps", "2", "--out-dir", str(out))
    assert r.returncode == 0 and "starting it over" in r.stdout and [r["step"] for r in _rows(out)] == [1, 2]


def test_a_run_that_stopped_before_its_first_checkpoint_says_how_to_start_over(tmp_path, monkeypatch, capsys):
    """Rows but no checkpoint (a kill at step 2 of a run saving only at its end): both a new run and
    --resume say the same way on (delete it, or another --out-dir), never each other's flag."""
    out = tmp_path / "run"
    _stop_at(monkeypatch, 2, train.RunError("stop"))
    assert _main(capsys, "--steps", "3", "--out-dir", str(out)).returncode == 1
    monkeypatch.undo()
    before = _tree(out)
    for more in ([], ["--resume"]):
        one_line(_main(capsys, "--steps", "3", "--out-dir", str(out), *more), 2, "stopped at step 1",
                 f"delete {out} to start over")
    assert _tree(out) == before


# ----------------------------------------------------------------------------- a history edited, lost, or cut short

@pytest.mark.parametrize("edit,words", [
    (lambda rows: [rows[1], rows[0]], "metrics.jsonl:2 is step 1 after step 2"),
    (lambda rows: [rows[0], rows[0], rows[1]], "metrics.jsonl:2 is step 1 after step 1"),
])
def test_rows_out_of_order_or_repeated_are_one_line(finished, tmp_path, capsys, edit, words):
    """floe writes each step's row once, in order: a file that says otherwise was edited, and a resume
    would keep it as the run's history."""
    out = _copy(finished, tmp_path)
    rows = (out / "metrics.jsonl").read_text().splitlines()
    (out / "metrics.jsonl").write_text("\n".join(edit(rows)) + "\n")
    before = _tree(out)
    one_line(_main(capsys, "--steps", "3", "--resume", "--out-dir", str(out)), 2, words, "rows are in step order")
    assert _tree(out) == before


def test_a_deleted_metrics_file_resumes_from_the_newest_checkpoint_saying_the_history_is_gone(finished, tmp_path,
                                                                                               clean3, capsys):
    """Its checkpoints are whole: the resume goes on from the newest, and the new file holds what follows."""
    out = _copy(finished, tmp_path)
    (out / "metrics.jsonl").unlink()
    r = _main(capsys, "--steps", "3", "--resume", "--out-dir", str(out))
    assert r.returncode == 0 and "metrics.jsonl is gone: resuming from step_000002 without the history" in r.stdout
    assert _strip(_rows(out)) == clean3[2:] and (out / "step_000001").is_dir()


def test_a_history_that_lacks_every_checkpoints_rows_names_the_way_on_that_keeps_them(finished, tmp_path, capsys):
    out = _copy(finished, tmp_path)
    (out / "metrics.jsonl").write_text("")
    before = _tree(out)
    one_line(_main(capsys, "--steps", "3", "--resume", "--out-dir", str(out)), 2, "lacks its metrics rows",
             f"delete {out / 'metrics.jsonl'} to resume from step_000002 without the history before it, or delete")
    assert _tree(out) == before


DIES = """
import os, threading
calls, lock = [0], threading.Lock()
def score(prompts, completions, **kw):
    with lock:
        calls[0] += 1
        if os.environ.get("FLOE_TEST_DIE") and calls[0] > 2:  # the second step's first group
            os._exit(0)
    return [0.5 + 0.1 * i for i in range(len(completions))]
"""


def test_a_run_that_user_code_ended_is_named_by_the_next_start(tmp_path, capsys):
    """os._exit in a reward ends the process where it stands, with status 0 and no line; the lock it
    never released tells the next start, which says so once and goes on."""
    f = tmp_path / "dies.py"
    f.write_text(DIES)
    out, flags = tmp_path / "run", ["--reward", f"{f}:score", "--save-every", "1", "--out-dir", str(tmp_path / "run")]
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), *SMALL, "--steps", "3", *flags], capture_output=True,
                       text=True, timeout=180, env={**os.environ, "FLOE_TEST_DIE": "1"})
    assert r.returncode == 0 and "summary" not in r.stdout and (out / "step_000001").is_dir()
    r = _main(capsys, "--steps", "3", "--resume", *flags)
    assert r.returncode == 0 and r.stdout.count("ended without its summary") == 1
    assert f"note: the last run in {out.absolute()} ended without its summary at step 1" in r.stdout
    assert "ended without" not in _main(capsys, "--steps", "4", "--resume", *flags).stdout


def test_a_fifo_named_config_json_in_the_run_is_refused_by_a_resume_not_read(tmp_path):
    """--resume read the run's config.json without asking what it was: a FIFO there blocked it forever."""
    out = tmp_path / "run"
    out.mkdir()
    os.mkfifo(out / "config.json")
    r = subprocess.run([sys.executable, str(Path(__file__).resolve().parent.parent / "train.py"), "--resume",
                        "--steps", "2", "--out-dir", str(out)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip() == (f"floe: error: --resume: {out} holds no floe run (no "
                                                      "checkpoint, no floe config.json)"), r.stderr
