"""The scripts no test runs (bench/, examples/) still import what exists: every floe module and
name they import, every attribute they read off an imported floe module, and every other module
they import, are there. Static (the files are parsed, not run), so it costs nothing, and it
catches a rename that leaves a study behind (bench/memory.py once imported `kernels`, a module
the reshape had renamed, inside a function no test called).

    python -m pytest -q tests/test_bench_imports.py
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# a root module shadows a bench script's name (bench/lora.py imports the root's lora)
OWN = {p.stem: p for p in [*ROOT.glob("bench/*.py"), *ROOT.glob("*.py")]}
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
    an attribute of a floe module imported whole (`import loss as L` ... `L.rl_loss`)."""
    out, aliases = [], {}
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                top = a.name.split(".")[0]
                if top in own:
                    aliases[a.asname or top] = top
                elif top not in ELSEWHERE and importlib.util.find_spec(top) is None:
                    out.append(f"line {node.lineno}: no module {top!r}")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            top = node.module.split(".")[0]
            if top in own and "." not in node.module:
                missing = [a.name for a in node.names if a.name != "*" and a.name not in defined(own[top])]
                out += [f"line {node.lineno}: {top} has no {name!r}" for name in missing]
            elif top not in own and top not in ELSEWHERE and importlib.util.find_spec(top) is None:
                out.append(f"line {node.lineno}: no module {top!r}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            module = aliases[node.value.id]
            if node.attr not in defined(own[module]):
                out.append(f"line {node.lineno}: {module} has no {node.attr!r}")
    return out


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_script_imports_what_exists(script):
    assert problems(script.read_text(), OWN) == []


def test_the_check_finds_a_renamed_module_a_missing_name_and_a_missing_attribute():
    source = ("import torch\n"
              "def study():\n"
              "    import kernels\n"
              "    from loss import no_such_loss, rl_loss\n"
              "    import model as M\n"
              "    return M.Transformer, M.no_such_class\n")
    assert problems(source, OWN) == ["line 3: no module 'kernels'", "line 4: loss has no 'no_such_loss'",
                                     "line 6: model has no 'no_such_class'"]


def test_gpu_sh_train_commands_parse_and_resolve_for_cuda():
    """Every train.py command bench/gpu.sh runs parses with today's flags and resolves for CUDA (a flag
    renamed or a pair refused would cost a GPU session its run); its pytest marker is registered."""
    import re
    import shlex

    import config as C

    text = (ROOT / "bench" / "gpu.sh").read_text().replace("\\\n", " ")
    lora = re.search(r'^LORA="([^"]*)"', text, re.M).group(1)
    lines = [line.replace("$LORA", lora).replace('"$OUT/', "/tmp/floe-gpu/").replace("$OUT/", "/tmp/floe-gpu/")
             for line in text.splitlines() if "train.py" in line and not line.lstrip().startswith("#")]
    assert len(lines) >= 4, lines
    for line in lines:
        words = shlex.split(line.split("train.py", 1)[1].split("2>&1")[0].split("&&")[0].strip().rstrip('"'))
        cfg = C.parse(words).resolve(True)
        assert cfg.device == "cuda", line
    assert "gpu:" in (ROOT / "pytest.ini").read_text() and " -m gpu " in text
