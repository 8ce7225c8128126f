"""The modules form layers (docs/design.md "Modules and layers"): the repo's own imports have no
cycle, and parallel.py, the bottom of the torchrun stack, imports no repo module at all.

Every import counts, wherever it sits: at the top of a file, inside a function (it runs on the
first call) or under `if TYPE_CHECKING:` (a type checker follows it). The files are parsed, not
imported, so the check needs none of their dependencies.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODULES = {p.stem: p for p in sorted(ROOT.glob("*.py"))}  # the flat modules in the repo root


def repo_imports(name: str) -> set[str]:
    """The other repo modules that module `name` imports anywhere in its file."""
    tree = ast.parse(MODULES[name].read_text(), filename=str(MODULES[name]))
    found = set()
    for node in ast.walk(tree):  # every scope: module, function, class, if-block
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found.add(node.module.split(".")[0])
    return (found & MODULES.keys()) - {name}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a path that ends where it starts, or None. Depth-first: reaching
    a module that is still on the current path closes a cycle."""
    path, done = [], set()

    def visit(m: str) -> list[str] | None:
        if m in path:
            return path[path.index(m):] + [m]
        if m in done:
            return None
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if cycle := visit(n):
                return cycle
        path.pop()
        done.add(m)
        return None

    for m in sorted(graph):
        if cycle := visit(m):
            return cycle
    return None


def test_find_cycle_names_the_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_repo_imports_have_no_cycle():
    graph = {m: repo_imports(m) for m in MODULES}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_parallel_imports_no_repo_module():
    """parallel.py depends on torch and the standard library alone; everything above may use it."""
    found = repo_imports("parallel")
    assert not found, f"parallel.py imports {', '.join(sorted(found))}"


def _below(name: str) -> set[str]:
    """Every repo module `name` imports, directly or through others."""
    seen, todo = set(), [name]
    while todo:
        for n in repo_imports(todo.pop()) - seen:
            seen.add(n)
            todo.append(n)
    return seen


def test_the_rollout_phase_sits_on_the_episodes_which_sit_on_the_engines():
    """The flow of one batch, bottom up: engines.py samples, episodes.py plays turns with it, rollout.py
    makes the step's batch from either, train.py trains on it; never the reverse. usercode.py (the
    isolation every reward and environment call goes through) and envs.py (the contract a forker
    copies) are layer 0."""
    assert "engines" in _below("episodes") and "episodes" not in _below("engines")
    assert "episodes" in _below("rollout") and "rollout" not in _below("episodes")
    assert "rollout" in _below("train") and "train" not in _below("rollout")
    assert not repo_imports("usercode") and not repo_imports("envs")


def test_bench_is_not_on_the_test_processes_path():
    """Every test module is imported before the first test runs, so this sees what any of them did at
    import time. bench/ on sys.path would let bench/lora.py stand in for lora.py in whichever import
    came next (tests load bench scripts with conftest.bench_module instead)."""
    import sys

    assert str(ROOT / "bench") not in sys.path
