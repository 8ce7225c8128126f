"""The scripts no test runs (bench/, examples/) still import what exists: every floe module and
name they import, every attribute they read off an imported floe module, and every other module
they import, are there. Static (the files are parsed, not run), so it costs nothing, and it
catches a rename that leaves a study behind (bench/memory.py once imported a module a reshape
had renamed, inside a function no test called).

    python -m pytest -q tests/test_bench_imports.py
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

from conftest import needs_vllm

ROOT = Path(__file__).resolve().parent.parent
ROOMS = ("agents", "engines", "layers", "run", "tasks")  # floe's folders, each a package
# by dotted name: "train", "layers", "layers.lora", and bench's own scripts (a floe module's name wins)
OWN = {p.stem: p for p in [*ROOT.glob("bench/*.py"), *ROOT.glob("*.py")]}
OWN |= {r: ROOT / r / "__init__.py" for r in ROOMS}
OWN |= {f"{r}.{p.stem}": p for r in ROOMS for p in (ROOT / r).glob("*.py") if p.stem != "__init__"}
ELSEWHERE = {"trl", "datasets"}  # bench/peers.py's TRL side: its own virtual environment (--trl-python)
SCRIPTS = sorted([*ROOT.glob("bench/*.py"), *ROOT.glob("examples/*.py")])


def defined(path: Path) -> set[str]:
    """The names a module defines at its top level (functions, classes, assignments, imports)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.If, ast.Try)):  # a guarded import or definition
            names |= {n.name for n in ast.walk(node) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
            names |= {(a.asname or a.name).split(".")[0] for n in ast.walk(node)
                      if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    return names


def problems(source: str, own: dict[str, Path]) -> list[str]:
    """What `source` imports or reads that is not there: a module, a name from a floe module, or
    an attribute of a floe module imported whole (`from run import hfdir` ... `hfdir.load`)."""
    out, bound = [], {}  # a name the source binds -> the floe module it is
    rooms = {m.split(".")[0] for m in own}
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                top = a.name.split(".")[0]
                if a.name in own:
                    bound[a.asname or top] = a.name if a.asname else top
                elif top in rooms:
                    out.append(f"line {node.lineno}: no module {a.name!r}")
                elif top not in ELSEWHERE and importlib.util.find_spec(top) is None:
                    out.append(f"line {node.lineno}: no module {top!r}")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            top = node.module.split(".")[0]
            if node.module in own:
                for a in node.names:
                    if f"{node.module}.{a.name}" in own:  # from run import hfdir
                        bound[a.asname or a.name] = f"{node.module}.{a.name}"
                    elif a.name != "*" and a.name not in defined(own[node.module]):
                        out.append(f"line {node.lineno}: {node.module} has no {a.name!r}")
            elif top in rooms:
                out.append(f"line {node.lineno}: no module {node.module!r}")
            elif top not in ELSEWHERE and importlib.util.find_spec(top) is None:
                out.append(f"line {node.lineno}: no module {top!r}")
    for node in ast.walk(tree):  # the outermost attribute of a chain: tasks.task.build
        if isinstance(node, ast.Attribute) and not isinstance(node.value, ast.Attribute):
            if not (isinstance(node.value, ast.Name) and node.value.id in bound):
                continue
            module, attr = bound[node.value.id], node.attr
            if f"{module}.{attr}" in own:
                continue
            if attr not in defined(own[module]):
                out.append(f"line {node.lineno}: {module} has no {attr!r}")
    for node in ast.walk(tree):  # a chain's later links: tasks.task.build
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                and isinstance(node.value.value, ast.Name) and node.value.value.id in bound):
            module = f"{bound[node.value.value.id]}.{node.value.attr}"
            if module in own and node.attr not in defined(own[module]):
                out.append(f"line {node.lineno}: {module} has no {node.attr!r}")
    return out


def imports_vllm(path: Path) -> bool:
    """Whether a script imports vllm anywhere (bench/turns.py does, where it imports): its check needs vllm."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return "vllm" in names


@pytest.mark.parametrize("script", [pytest.param(p, marks=[pytest.mark.vllm, needs_vllm]) if imports_vllm(p) else p
                                    for p in SCRIPTS], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_script_imports_what_exists(script):
    assert problems(script.read_text(), OWN) == []


def test_the_check_finds_a_renamed_module_a_missing_name_and_a_missing_attribute():
    source = ("import torch\n"
              "def study():\n"
              "    import lm_head\n"
              "    from loss import no_such_loss, rl_loss\n"
              "    from run import hfdir, nohere\n"
              "    import run.start\n"
              "    from engines.vllm import make_engine\n"
              "    return hfdir.load, hfdir.no_such_load, run.start.build, run.start.no_build\n")
    assert problems(source, OWN) == ["line 3: no module 'lm_head'", "line 4: loss has no 'no_such_loss'",
                                     "line 5: run has no 'nohere'", "line 7: no module 'engines.vllm'",
                                     "line 8: run.hfdir has no 'no_such_load'", "line 8: run.start has no 'no_build'"]


def gpu_sh_commands() -> list[list[str]]:
    """The flags of every train.py command bench/gpu.sh runs, its $LORA and $OUT filled in."""
    import re
    import shlex

    text = (ROOT / "bench" / "gpu.sh").read_text().replace("\\\n", " ")
    lora = re.search(r'^LORA="([^"]*)"', text, re.M).group(1)
    lines = [line.replace("$LORA", lora).replace('"$OUT/', "/tmp/floe-gpu/").replace("$OUT/", "/tmp/floe-gpu/")
             for line in text.splitlines() if "train.py" in line and not line.lstrip().startswith("#")]
    return [shlex.split(line.split("train.py", 1)[1].split("2>&1")[0].split("&&")[0].strip().rstrip('"')) for line in lines]


GPU_SH = gpu_sh_commands()


def test_gpu_sh_runs_train_commands_and_the_gpu_marked_tests():
    """gpu.sh's commands were found (the parse below checks each), and its pytest marker is registered."""
    text = (ROOT / "bench" / "gpu.sh").read_text()
    assert len(GPU_SH) >= 4, GPU_SH
    assert "gpu:" in (ROOT / "pytest.ini").read_text() and " -m gpu " in text


def command_id(words: list[str]) -> str:
    """A gpu.sh command by its run directory, and its --engine where it names one: "run-lora --engine vllm"."""
    name = Path(words[words.index("--out-dir") + 1]).name
    return " ".join([name, *words[words.index("--engine"):][:2]]) if "--engine" in words else name


# --engine vllm resolves only where vllm imports (gpu.sh runs that command only there)
@pytest.mark.parametrize("words", [pytest.param(w, marks=[pytest.mark.vllm, needs_vllm]) if "vllm" in w else w
                                   for w in GPU_SH], ids=command_id)
def test_gpu_sh_train_commands_parse_and_resolve_for_cuda(words):
    """Every train.py command bench/gpu.sh runs parses with today's flags and resolves for CUDA (a flag
    renamed or a pair refused would cost a GPU session its run)."""
    from config import parse

    assert parse(words).resolve(True).device == "cuda", words
