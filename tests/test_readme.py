"""Every command README.md shows runs when pasted into a fresh clone: a `python train.py ...` (or
`torchrun ... train.py ...`) parses with train.py's own parser (config.parse) and every input it
names is there; a `python -m MODULE` names a module that exists; a `python FILE.py` names a file
that exists and runs as a script; a `pip install -r FILE` names a file that exists. Static: nothing
is trained or installed.

The commands are read where README shows them: its indented code blocks (outside ``` fences, with
backslash continuations joined), each line split at `&&`, so `pip install ... && python train.py ...`
counts; and its inline code spans that start with `python`, `torchrun` or `pip`.

The rule for a path a command names (--task jsonl:PATH, --tool PATH:fn, --reward PATH:fn,
--env PATH:Class, --model DIR, --eval-file PATH, --adapter DIR, a script, a requirements file):
- relative: it is read from the repo root, so it must be in a fresh clone: a file git tracks, or a
  directory holding tracked files (--model's: its config.json). A file a README command writes
  (`python -m agents.envs calculator calc.jsonl`) is not one, nor a word like DIR;
- absolute: the reader's own, so it must be visibly a placeholder: under /path/to/
  (`--model /path/to/Qwen3-0.6B`); any other absolute path is an error;
- PATH:name also needs `name` defined at the top level of PATH; a built-in (`--reward numeric_match`,
  `--env guess-letter`, `--task arithmetic`) must be one of floe's, and `module:name` must import.
--out-dir is written, not read, and is not checked.

    python -m pytest -q tests/test_readme.py
"""

from __future__ import annotations

import ast
import contextlib
import functools
import io
import importlib.util
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from agents import envs
from config import parse
from tasks import rewards
from tasks.task import TASKS

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
PLACEHOLDER = "/path/to/"
PROGRAMS = ("python", "torchrun", "pip")


@functools.cache
def tracked() -> frozenset[str]:
    """The repo's files as a fresh clone has them: git's index, or every file where there is no git."""
    if (ROOT / ".git").exists():
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        return frozenset(out.splitlines())
    return frozenset(p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*") if p.is_file())


def shell_lines(markdown: str) -> list[str]:
    """The lines of its indented code blocks (continuations joined), then its inline code spans that
    start with a program."""
    out, prose, fenced = [], [], False
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif fenced:
            continue
        elif line.startswith("    ") and line.strip():
            if out and out[-1].endswith("\\"):  # a continuation of the line above
                out[-1] = out[-1][:-1].rstrip() + " " + line.strip()
            else:
                out.append(line.strip())
        else:
            prose.append(line)
    spans = re.findall(r"`((?:%s) [^`]*)`" % "|".join(PROGRAMS), "\n".join(prose))
    return out + spans


def commands(markdown: str) -> list[list[str]]:
    """Each command of its shell lines, as words; lines that are no command (a log line, a JSON row,
    Python) are left out."""
    out = []
    for line in shell_lines(markdown):
        for part in line.split("&&"):
            words = shlex.split(part)
            if words and words[0] in PROGRAMS:
                out.append(words)
    return out


def train_args(words: list[str]) -> list[str] | None:
    """train.py's arguments in a command that runs it (python or torchrun), else None."""
    if words[0] in ("python", "torchrun") and "train.py" in words:
        return words[words.index("train.py") + 1:]
    return None


def missing(flag: str, path: str, kind: str = "file") -> list[str]:
    """What is wrong with a path a command reads (the module docstring's rule); kind: file, dir or model."""
    if path.startswith(PLACEHOLDER):
        return []
    if os.path.isabs(path) or path.startswith("~"):
        return [f"{flag} {path}: an absolute path that is not a placeholder under {PLACEHOLDER}"]
    rel = Path(os.path.normpath(path)).as_posix()
    files = tracked()
    there = {"file": rel in files, "dir": any(f.startswith(rel + "/") for f in files),
             "model": f"{rel}/config.json" in files}[kind]
    return [] if there else [f"{flag} {path}: not in the repo" + (" (no config.json)" if kind == "model" else "")]


def defines(path: str, name: str) -> bool:
    """Whether the file defines `name` at its top level (a function, class or assignment)."""
    for node in ast.parse((ROOT / path).read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return True
    return False


def loadable(flag: str, spec: str, builtin) -> list[str]:
    """A built-in name, PATH.py:name or module:name, as tasks/usercode.py's `load` reads it."""
    if spec in builtin:
        return []
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name:
        return [f"{flag} {spec}: neither a built-in ({', '.join(builtin)}) nor PATH.py:name or module:name"]
    if where.endswith(".py") or "/" in where:
        if problems := missing(flag, where):
            return problems
        return [] if where.startswith(PLACEHOLDER) or defines(where, name) else [f"{flag} {spec}: {where} has no {name!r}"]
    return [] if importlib.util.find_spec(where) else [f"{flag} {spec}: no module {where!r}"]


def train_problems(args: list[str]) -> list[str]:
    """What would stop a train.py command before it starts, as far as its flags and inputs go."""
    if "--help" in args:
        return []
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            cfg = parse(args)
    except SystemExit:  # parse's one line says why
        return [f"train.py {' '.join(args)}: {err.getvalue().strip()}"]
    out = []
    if cfg.task.startswith("jsonl:"):
        out += missing("--task", cfg.task.removeprefix("jsonl:"))
    elif cfg.task not in TASKS:
        out.append(f"--task {cfg.task}: no built-in task")
    for spec in cfg.reward:
        out += loadable("--reward", spec, rewards.BUILTIN)
    for spec in cfg.tool:
        out += loadable("--tool", spec, {})
    if cfg.env:
        out += loadable("--env", cfg.env, envs.BUILTIN)
    if cfg.model != "scratch":  # --stage sft --model scratch: a random model, no directory
        out += missing("--model", cfg.model, "model")
    if cfg.eval_file:
        out += missing("--eval-file", cfg.eval_file)
    if cfg.adapter:
        out += missing("--adapter", cfg.adapter, "dir")
    return out


def runs_as_script(path: str) -> bool:
    return '__name__ == "__main__"' in (ROOT / path).read_text()


def command_problems(words: list[str]) -> list[str]:
    """What would stop a command before it starts: its script or module, its requirements, train.py's flags."""
    out = []
    if words[0] == "pip":
        out += [p for i, w in enumerate(words[:-1]) if w in ("-r", "--requirement") for p in missing("pip -r", words[i + 1])]
    elif words[0] == "python" and words[1:2] == ["-m"]:
        module = words[2]
        own = module.replace(".", "/")
        if any(f.startswith(own.split("/")[0] + "/") or f == own.split("/")[0] + ".py" for f in tracked()):
            if f"{own}.py" in tracked():
                out += [] if runs_as_script(f"{own}.py") else [f"python -m {module}: {own}.py does not run as a script"]
            elif f"{own}/__main__.py" not in tracked():
                out.append(f"python -m {module}: no module {module!r} in the repo")
        elif importlib.util.find_spec(module) is None:  # another package's (pytest)
            out.append(f"python -m {module}: no module {module!r}")
    else:  # python FILE.py ... or torchrun ... FILE.py ...
        script = next((w for w in words[1:] if w.endswith(".py")), None)
        if script is None:
            out.append(f"{' '.join(words)}: runs no script")
        elif problems := missing(words[0], script):
            out += problems
        elif not runs_as_script(script):
            out.append(f"{words[0]} {script}: does not run as a script")
    if (args := train_args(words)) is not None:
        out += train_problems(args)
    return out


COMMANDS = commands(README)


def test_the_readme_commands_are_found():
    """The reading sees each form README uses: a plain block line, `pip ... && python train.py ...`, a
    backslash continuation, torchrun, and inline spans."""
    trains = [train_args(w) for w in COMMANDS if train_args(w) is not None]
    assert len(trains) >= 7, trains
    assert ["--loss", "icepop", "--icepop-beta", "2.0"] in trains  # the main job, after `pip install ... &&`
    assert any("--reward-weights" in a and "--prompts-per-step" in a for a in trains)  # three lines joined
    assert any(w[0] == "torchrun" for w in COMMANDS)
    assert ["python", "plot.py", "runs/latest"] in COMMANDS and ["python", "-m", "pytest", "-q"] in COMMANDS
    assert any(w[:3] == ["python", "-m", "agents.envs"] for w in COMMANDS)


@pytest.mark.parametrize("words", COMMANDS, ids=lambda w: " ".join(w)[:80])
def test_every_readme_command_names_what_exists(words):
    assert command_problems(words) == []


def test_the_check_catches_a_command_that_would_not_run():
    """The tool example as README once showed it (calc.jsonl is not at the root, DIR is a word), beside
    what the rule lets through (a placeholder under /path/to/) and what else it stops."""
    old = ("Text.\n\n"
           "    python train.py --task jsonl:calc.jsonl --tool examples/calculator.py:add --reward numeric_match --model DIR\n"
           "    python train.py --task jsonl:examples/sums.jsonl --model /path/to/Qwen3-0.6B --reward examples/rewards.py:no_such \\\n"
           "        --env nowhere.py:Env --eval-file /home/me/eval.jsonl\n"
           "    python train.py --no-such-flag\n\n"
           "Run `python -m agents.nope x` or `python bench/nope.py`, then `pip install -r nope.txt`.\n")
    found = [command_problems(w) for w in commands(old)]
    assert found == [
        ["--task calc.jsonl: not in the repo", "--model DIR: not in the repo (no config.json)"],
        ["--reward examples/rewards.py:no_such: examples/rewards.py has no 'no_such'", "--env nowhere.py: not in the repo",
         f"--eval-file /home/me/eval.jsonl: an absolute path that is not a placeholder under {PLACEHOLDER}"],
        ["train.py --no-such-flag: floe: error: Unrecognized options: --no-such-flag (train.py --help lists every flag)"],
        ["python -m agents.nope: no module 'agents.nope' in the repo"],
        ["python bench/nope.py: not in the repo"],
        ["pip -r nope.txt: not in the repo"],
    ]
