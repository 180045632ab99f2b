"""The house's layout, read from the code (docs/design.md#the-house): the packages in layers, every import
pointing down, no import cycle between modules, no module past STYLE's size rule, no `sys.path` edit.
`make lint` runs this file beside ruff; it takes a second."""

import ast
from pathlib import Path

import pytest

from tests.helpers import REPO

# Bottom to top: the shared packages, the stages in the order they run, the measurement tools. A module
# imports from its own package or from one below it; nothing imports from bench/.
LAYERS = ["artifacts", "target", "heads", "data_prep", "train", "export", "eval", "watch", "bench"]
# STYLE.md: modules of 100-400 lines; past this a module fails (`make lint`), before a newcomer has to read
# 800 lines to find one loss.
MAX_LINES = 450


def modules() -> dict[str, Path]:
    """Every module of the product and its tools, by dotted name."""
    found = {}
    for package in LAYERS:
        for path in sorted((REPO / package).rglob("*.py")):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def imports(path: Path) -> set[str]:
    """The absolute imports of a module anywhere in it (at the top or inside a function: a cycle through a
    late import is still a cycle), as dotted module names."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)  # a submodule by `from`
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def graph() -> dict[str, set[str]]:
    """module -> the product modules it imports (a package's import reaches its __init__)."""
    found = modules()
    return {name: {i for i in imports(path) if i in found} - {name} for name, path in found.items()}


def test_every_import_points_down():
    wrong = []
    for name, targets in graph().items():
        layer = LAYERS.index(name.split(".")[0])
        wrong += [f"{name} imports {t}" for t in targets if LAYERS.index(t.split(".")[0]) > layer]
    assert not wrong, (
        "imports pointing up (LAYERS, bottom to top: " + " < ".join(LAYERS) + "):\n" + "\n".join(wrong)
    )


def find_cycles(edges: dict[str, set[str]]) -> list[str]:
    """Each import cycle found by a depth-first walk, as `a -> b -> a`."""
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node], stack = "open", [*stack, node]
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":  # on the stack: the walk came back to it
                cycles.append(" -> ".join([*stack[stack.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, stack)
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [])
    return cycles


def test_no_import_cycle_between_modules():
    cycles = find_cycles(graph())
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


@pytest.mark.parametrize("package", LAYERS)
def test_no_module_past_the_size_rule(package):
    long = {
        str(path.relative_to(REPO)): n
        for path in (REPO / package).rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines (STYLE.md: 100-400; split by concern): {long}"


def edits_sys_path(source: str) -> bool:
    """Whether the code calls sys.path.insert / append / extend."""
    return any(
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in ("insert", "append", "extend")
        and ast.unparse(node.func.value) == "sys.path"
        for node in ast.walk(ast.parse(source))
    )


def test_no_script_edits_sys_path():
    # Scripts run from the repository root (`python <stage>/main.py`, through `pip install -e .`) or as
    # modules (`python -m bench.<tool>`); only the tests' conftest may set the path up.
    edits = [
        str(path.relative_to(REPO))
        for package in [*LAYERS, "tests"]
        for path in (REPO / package).rglob("*.py")
        if path.name != "conftest.py" and edits_sys_path(path.read_text())
    ]
    assert not edits, f"sys.path edited in {edits}"


def test_the_checks_find_what_they_look_for(tmp_path):
    # The checks above on code written to break each rule: a late import, a cycle, a path edit.
    module = tmp_path / "m.py"
    module.write_text("import sys\n\ndef f():\n    from eval.main import run\n    sys.path.insert(0, '.')\n")
    assert {"eval.main", "eval.main.run"} <= imports(module)
    assert edits_sys_path(module.read_text()) and not edits_sys_path("import sys\nprint(sys.path)\n")
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a -> b -> c -> a"]
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
