"""The modules form layers (docs/design.md "Modules and layers"): the repo's own imports have no
cycle, neither between modules nor between the rooms (a folder, or a file on top), and
layers/parallel.py, the bottom of the torchrun stack, imports no repo module at all. The top
level holds the card's files; floe's own names are imported by name, never under an alias.

Every import counts, wherever it sits: at the top of a file, inside a function (it runs on the
first call) or under `if TYPE_CHECKING:` (a type checker follows it). The files are parsed, not
imported, so the check needs none of their dependencies.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROOMS = ("agents", "engines", "layers", "run", "tasks")  # the folders of floe's modules
CARD = {"train", "loss", "kernels", "rollout", "data", "config", "model", "plot"}  # the top level
MODULES = {p.stem: p for p in sorted(ROOT.glob("*.py"))}  # "train", "layers.lora", ...
MODULES |= {f"{r}.{p.stem}": p for r in ROOMS for p in sorted((ROOT / r).glob("*.py")) if p.stem != "__init__"}


def repo_imports(name: str) -> set[str]:
    """The other repo modules that module `name` imports anywhere in its file."""
    tree = ast.parse(MODULES[name].read_text(), filename=str(MODULES[name]))
    found = set()
    for node in ast.walk(tree):  # every scope: module, function, class, if-block
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}  # from run import hfdir
    return (found & MODULES.keys()) - {name}


def room(name: str) -> str:
    return name.split(".")[0]


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


def test_the_rooms_have_no_cycle():
    """A folder is one room, a file on top another: no room imports one that imports it back, so
    a reader can skip a folder knowing nothing below it reaches up into it."""
    graph = {}
    for m in MODULES:
        graph.setdefault(room(m), set()).update(room(n) for n in repo_imports(m) if room(n) != room(m))
    cycle = find_cycle(graph)
    assert cycle is None, "rooms in a cycle: " + " -> ".join(cycle)


def test_the_top_level_is_the_card_and_every_room_holds_several_modules():
    assert set(p.stem for p in ROOT.glob("*.py")) == CARD
    for r in ROOMS:
        assert len(list((ROOT / r).glob("*.py"))) > 2, f"{r}/ holds one module: it belongs in a neighbour"
        assert (ROOT / r / "__init__.py").is_file(), f"{r}/ has no __init__.py: another package named {r} would win"


def own_imports_under_another_name(path: Path) -> list[str]:
    """`import loss as L` or `from config import LORA_TARGETS as TARGETS` for a floe module: the
    lines where grep and go-to-definition lose which module a name comes from."""
    tops = {room(m) for m in MODULES}
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {a.name} as {a.asname}" for a in node.names
                      if a.asname and room(a.name) in tops]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and room(node.module) in tops:
            found += [f"line {node.lineno}: from {node.module} import {a.name} as {a.asname}" for a in node.names
                      if a.asname and a.asname != a.name]
    return found


def test_floe_imports_its_own_names_by_name():
    """Outside tests/ (bench/ and examples/ included) every floe module and name is imported under
    its own name, so a call's module is the one its import names."""
    files = [p for p in sorted(ROOT.rglob("*.py")) if p.relative_to(ROOT).parts[0] not in ("tests", ".git")]
    found = {str(p.relative_to(ROOT)): f for p in files if (f := own_imports_under_another_name(p))}
    assert not found, found


def test_an_aliased_import_is_found(tmp_path):
    f = tmp_path / "x.py"
    f.write_text("import loss as L\nfrom layers.lora import TARGETS as T\nfrom layers import lora\nimport numpy as np\n"
                 "def g():\n    import run.start as s\n")
    assert own_imports_under_another_name(f) == ["line 1: import loss as L", "line 2: from layers.lora import TARGETS as T",
                                                 "line 6: import run.start as s"]


def test_parallel_imports_no_repo_module():
    """layers/parallel.py depends on torch and the standard library alone; everything above may use it."""
    found = repo_imports("layers.parallel")
    assert not found, f"layers/parallel.py imports {', '.join(sorted(found))}"


def _below(name: str) -> set[str]:
    """Every repo module `name` imports, directly or through others."""
    seen, todo = set(), [name]
    while todo:
        for n in repo_imports(todo.pop()) - seen:
            seen.add(n)
            todo.append(n)
    return seen


def test_the_rollout_phase_sits_on_the_episodes_which_sit_on_the_engines():
    """The flow of one batch, bottom up: the engines sample (engines/torch_engine.py), the episodes
    play turns with them (agents/episodes.py), rollout.py makes the step's batch from either,
    train.py trains on it; never the reverse. tasks/usercode.py (the isolation every reward and
    environment call goes through) and agents/envs.py (the contract a forker copies) are layer 0."""
    assert "engines.torch_engine" in _below("agents.episodes") and "agents.episodes" not in _below("engines.torch_engine")
    assert "agents.episodes" in _below("rollout") and "rollout" not in _below("agents.episodes")
    assert "rollout" in _below("train") and "train" not in _below("rollout")
    assert not repo_imports("tasks.usercode") and not repo_imports("agents.envs")


def test_bench_is_not_on_the_test_processes_path():
    """Every test module is imported before the first test runs, so this sees what any of them did at
    import time. bench/ on sys.path would let bench/lora.py stand in for layers/lora.py in whichever import
    came next (tests load bench scripts with conftest.bench_module instead)."""
    import sys

    assert str(ROOT / "bench") not in sys.path
