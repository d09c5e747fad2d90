"""whale/ has no import cycle: every module's imports (at the top, under `if TYPE_CHECKING:`, and
inside functions alike) form a graph without a circle, so each module can be read after the ones
it names and none reaches back into its callers' state."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "whale"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module an `ImportFrom` names (relative imports resolved against `module`)."""
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def import_graph() -> dict[str, set[str]]:
    """Module -> the whale modules it imports anywhere in its source. `from a import b` counts as
    importing a.b where a.b is a module, else a; importing a.b also runs a (its __init__)."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        found: set[str] = set()
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(module, path.name == "__init__.py", node)
                names = [f"{target}.{alias.name}" if f"{target}.{alias.name}" in files else target
                         for alias in node.names]
            else:
                continue
            for name in names:
                while name and name not in files:  # a name inside a module: the module
                    name = name.rpartition(".")[0]
                if name.startswith("whale"):
                    found.add(name)
                    parent = name.rpartition(".")[0]
                    while parent:  # importing a.b.c runs a and a.b first
                        found.add(parent)
                        parent = parent.rpartition(".")[0]
        found.discard(module)
        graph[module] = {m for m in found if not module.startswith(m + ".")}  # a package's own parents
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_every_kind_of_import():
    """The walk finds imports at the top, under TYPE_CHECKING and inside functions."""
    graph = import_graph()
    assert len(graph) > 50 and "whale.engine.hf" in graph
    assert "whale.engine.base" in graph["whale.engine.hf"]  # top-level `from whale.engine.base import ...`
    assert "whale.engine.hf" in graph["whale.engine"]  # function-local, inside make_engine
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_whale_has_no_import_cycle():
    found = cycles(import_graph())
    assert found == [], "import cycles (each a set of modules that import each other):\n" + "\n".join(
        " <-> ".join(c) for c in found)
