"""The run directory: what --out-dir must hold for a new run or a resume to start in it, the
lock a run holds on it, and files written there never through a link.

One directory holds one run. A new run needs a new or empty directory, or one whose run
stopped before its first step (`check_fresh`: it is started over, saying so); a directory
that is not floe's (a model directory above all) is never written into. Rank 0 holds the
directory for the whole run (`claimed`: an flock on `.lock`, which the kernel drops when
the process dies; a lock still holding its id tells the next run it was never released), and
every file it writes under a temporary name is created new (`create_new`: a stale one, or a
symlink planted there, is unlinked, never followed) and renamed into place only while that
name still holds the file it wrote (`publish`).
run/checkpoint.py holds the checkpoints and resume; docs/faults.md lists each case and its line.

    python -m pytest -q tests/test_faults.py
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import stat
from pathlib import Path

from config import ConfigError
from layers.parallel import RANK, gather, world

STATE = "trainer_state"  # a checkpoint's sub-folder, so vLLM's *.safetensors glob sees only the model
FLOE_KEYS = {"stage", "loss", "out_dir", "prompts_per_step"}  # a config.json with these is a floe run's


# ----------------------------------------------------------------------------- files, never followed

def create_new(path: Path):
    """A new regular file at `path`, open for writing. A stale one (a torn write, or a symlink planted
    there) is unlinked first, never followed; O_EXCL | O_NOFOLLOW refuse whatever appears in between."""
    path.unlink(missing_ok=True)  # a symlink: the link itself goes (a directory there raises: not floe's)
    return open(path, "w", opener=lambda p, flags: os.open(p, flags | os.O_EXCL | os.O_NOFOLLOW, 0o644))


def publish(f, dest: Path) -> None:
    """Rename `f` (a create_new file, still open) over `dest`: its data on disk first, and only while
    its name still holds that file, so what lands at `dest` is the regular file floe wrote."""
    f.flush()
    os.fsync(f.fileno())
    if not _same_file(f.fileno(), Path(f.name)):
        raise OSError(errno.ESTALE, "replaced while it was written", str(f.name))
    os.replace(f.name, dest)


def write_file(dest: Path, text: str) -> None:
    """`dest` replaced whole through dest.tmp: a full disk mid-write leaves the old one."""
    with create_new(dest.with_name(dest.name + ".tmp")) as f:
        f.write(text)
        publish(f, dest)


def _same_file(fd: int, path: Path) -> bool:
    try:
        a, b = os.fstat(fd), os.lstat(path)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def regular(path: Path) -> bool:
    """A regular file itself at `path` (a symlink to one is not)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


# ----------------------------------------------------------------------------- what a directory holds

def checkpoints(out: Path) -> list[Path]:
    """The run's complete checkpoints, newest first (a torn write leaves only a .tmp folder)."""
    done = [p for p in out.glob("step_*") if re.fullmatch(r"step_\d{6}", p.name) and (p / STATE / "state.json").is_file()]
    return sorted(done, reverse=True)


def snapshot(out: Path) -> tuple:
    """What the start's checks saw of the directory (each entry's name, size and mtime; `.lock`
    aside), compared again once the lock is held: a run that came and went in between is caught."""
    if not out.is_dir():
        return ()
    return tuple(sorted((p.name, st.st_size, st.st_mtime_ns) for p in out.iterdir() if p.name != ".lock"
                        for st in (p.lstat(),)))


def floe_config(out: Path) -> dict | None:
    """config.json when it is a floe run's (FLOE_KEYS), else None: a model's config.json is not."""
    if not (out / "config.json").is_file():  # a FIFO would block the read forever
        return None
    try:
        saved = json.loads((out / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return saved if isinstance(saved, dict) and FLOE_KEYS <= saved.keys() else None


def row_step(row) -> int | None:
    """A metrics row's step: a JSON object with an integer step >= 0, else None."""
    step = row.get("step") if isinstance(row, dict) else None
    return step if type(step) is int and step >= 0 else None


def trained_steps(out: Path) -> set[int]:
    """The steps (1 on) metrics.jsonl holds a row of; what is not a row is passed over here."""
    path, steps = out / "metrics.jsonl", set()
    for line in (path.read_text(errors="replace").splitlines() if path.is_file() else []):
        with contextlib.suppress(ValueError):
            steps.add(row_step(json.loads(line)) or 0)
    return steps - {0}


def start_over(out: Path) -> str:
    """How to start over in a run directory without a checkpoint: a run that trained no step is
    started over by a new run's command (check_fresh); one with step rows stays until deleted."""
    if trained_steps(out):
        return f"delete {out} to start over, or give another --out-dir"
    return "run it again without --resume to start over"


def way_on(out: Path) -> str:
    """Where a run stopped goes on (a Ctrl-C's line): its newest checkpoint, or how to start over."""
    done = checkpoints(out) if out.is_dir() else []
    return f"--resume continues from step {int(done[0].name[5:])}" if done else f"no checkpoint yet: {start_over(out)}"


# ----------------------------------------------------------------------------- a new run; the lock

def check_fresh(out: Path, model: str) -> str | None:
    """A new run needs a new or empty directory (`.lock` aside), or one whose run stopped before its
    first step (floe's config.json, no checkpoint, no step's row: a failure at step 1), which it
    starts over, saying so (the note returned). Anything else is refused, naming the way on: a
    run to --resume, a run that stopped before its first checkpoint, or a directory that is not
    floe's (a model directory above all: a run never writes into its --model)."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out-dir {out}: is a file, not a directory")
    if model != "scratch" and Path(model).resolve() in (out.resolve(), *out.resolve().parents):
        raise ConfigError(f"--out-dir {out} is the --model directory or inside it ({model}): a run never writes "
                            "into its model; give another --out-dir")
    names = sorted(p.name for p in out.iterdir() if p.name != ".lock") if out.is_dir() else []
    if not names:
        return None
    if checkpoints(out):
        raise ConfigError(f"--out-dir {out} holds a run already: add --resume to continue it, or give another "
                            "--out-dir (or delete that directory to start over)")
    if done := trained_steps(out):
        raise ConfigError(f"--out-dir {out} holds a run that stopped at step {max(done)}, before its first "
                            f"checkpoint (nothing to resume): {start_over(out)}")
    if floe_config(out) is None:
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        raise ConfigError(f"--out-dir {out} is not empty and holds no floe run (it holds {shown}; no floe "
                            "config.json): give a new or empty directory")
    return f"note: --out-dir {out} holds a run that stopped before its first step (no checkpoint); starting it over"


class RunLock:
    """Rank 0's hold on the run directory from before its first write to the end of the run: an
    flock on `.lock`, which the kernel drops when the process dies (a SIGKILL leaves no stale
    lock). The file is removed at release, while still held; a taker then checks that the path
    still names the file it locked and otherwise takes the new one (without that, a run locking
    the removed file and one locking its replacement would both hold "the" lock)."""

    def __init__(self, out: Path):
        self.path, self.fd = out / ".lock", None
        for _ in range(10):
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
            except OSError as e:  # a symlink or a directory planted there (never followed), a read-only disk
                raise ConfigError(f"--out-dir {out}: cannot lock {self.path} ({e.strerror})") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise ConfigError(f"--out-dir {out} is in use by another run (it holds {self.path}): wait for it "
                                    "to end, or give another --out-dir") from None
            if _same_file(fd, self.path):
                self.fd = fd
                self._mark(out)
                return
            os.close(fd)  # released and removed by the run that held it: take the new one
        raise ConfigError(f"--out-dir {out}: {self.path} keeps changing (runs starting and ending in it?)")

    def _mark(self, out: Path) -> None:
        """Write this process's id into the lock. A lock that holds one when taken was left by a run that
        ended without its release (a kill, user code's os._exit): its own last line never came, so say it."""
        if os.pread(self.fd, 64, 0):
            done = trained_steps(out)
            print(f"note: the last run in {out} ended without its summary "
                  f"{f'at step {max(done)}' if done else 'before its first step'} (killed, or user code called "
                  "os._exit, which nothing in the process can report)", flush=True)
        with contextlib.suppress(OSError):  # a full disk: the lock holds all the same
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)

    def release(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                self.path.unlink()  # while still held: a run starting now makes (and locks) a new one
            os.close(self.fd)
            self.fd = None


@contextlib.contextmanager
def claimed(out: Path, seen: tuple):
    """Rank 0 takes --out-dir once every check passed: makes it (and missing parents), locks it
    (RunLock), and checks it is still as check_start saw it (`seen`, a snapshot). A start that
    fails after that (the engine refuses a flag, a full disk) takes back what it wrote: the
    topmost folder it made (--out-dir itself when it was new), or the scratch/ model it added to
    an existing one, a torn config.json.tmp, and the lock. An existing config.json is only ever
    replaced whole (write_file), so --out-dir is left as it was. Yields the lock (None on the
    other ranks), held until the caller releases it at the run's end."""
    if RANK:
        yield None
        return
    out = out.absolute()
    made = [p for p in (*reversed(out.parents), out) if not p.exists()][:1]
    out.mkdir(parents=True, exist_ok=True)
    lock = RunLock(out)  # held by another run: the directory is that run's, so nothing here is undone
    made = made or ([] if (out / "scratch").exists() else [out / "scratch"])
    try:
        if snapshot(out) != seen:
            raise ConfigError(f"--out-dir {out} changed while this run was starting (another run wrote to it): "
                                "run the command again")
        yield lock
    except BaseException:  # SystemExit from `fail` and KeyboardInterrupt too
        for p in made:
            shutil.rmtree(p, ignore_errors=True)
        with contextlib.suppress(OSError):
            (out / "config.json.tmp").unlink(missing_ok=True)
        lock.release()
        raise


def check_shared(out: Path) -> None:
    """Under torchrun every rank writes its part of a checkpoint into one directory, which rank 0 then
    renames: the ranks must share --out-dir's filesystem. Rank 0 writes a token into it, every rank
    reads it back, and all reach one verdict (ranks that cannot see each other's files stop with one
    line). The token file is removed either way."""
    if world() == 1:
        return
    probe, token = out.absolute() / ".ranks", os.urandom(16).hex()
    if RANK == 0:
        with create_new(probe) as f:
            f.write(token)
            publish(f, probe)
    token = gather([token])[0]  # rank 0's, once its file is in place
    try:
        seen = probe.read_text() == token
    except OSError:
        seen = False
    blind = [r for r, ok in enumerate(gather([seen])) if not ok]  # every rank has read it
    if RANK == 0:
        probe.unlink(missing_ok=True)
    gather([None])  # no rank returns while the token file is still there
    if blind:
        raise ConfigError(f"--out-dir {out}: rank {blind[0]} cannot see the files rank 0 writes there (another "
                            "machine's disk?); every rank writes its part of a checkpoint into one directory: give an "
                            "--out-dir on a filesystem all ranks share")
