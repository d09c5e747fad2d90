"""whale/ has no import cycle: every module's imports (at the top, under `if TYPE_CHECKING:`, and
inside functions alike) form a graph without a circle, so each module can be read after the ones
it names and none reaches back into its callers' state. Imports sit at the top of their modules;
the few left inside functions (optional extras, heavy modules kept off light paths) each say why."""

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


# Imports of whale modules that stay inside functions, and why; every other whale import is at the
# top of its module. (importing module, imported module) -> the reason it is lazy.
LAZY_WHALE_IMPORTS = {
    ("whale.cli", "whale.evaluate"): "torch: `whale --help` and `whale config` stay light",
    ("whale.cli", "whale.run"): "torch, transformers",
    ("whale.cli", "whale.report"): "matplotlib",
    ("whale.cli", "whale.compare"): "matplotlib",
    ("whale.cli", "whale.matrix"): "torch, matplotlib",
    ("whale.domains", "whale.domains.searchqa"): "only the chosen domain loads (bm25s, scipy)",
    ("whale.domains", "whale.domains.math"): "only the chosen domain loads (math-verify, sympy)",
    ("whale.domains", "whale.domains.chess"): "only the chosen domain loads (python-chess)",
    ("whale.domains", "whale.domains.reasoning_gym"): "only the chosen domain loads",
    ("whale.domains", "whale.domains.verifiers_env"): "only the chosen domain loads (asyncio)",
    ("whale.engine", "whale.engine.hf"): "torch, transformers, peft: only the hf and vllm backends",
    ("whale.engine", "whale.engine.vllm"): "torch: only the vllm backend",
    ("whale.engine", "whale.engine.openai"): "the HTTP stack: only the openai backend",
    ("whale.engine.default_model", "whale.engine.hub"): "huggingface_hub reads HF_HUB_OFFLINE once, when "
                                                        "imported; the command line sets it later",
}


def function_local_imports(source: str, module: str, is_package: bool = False) -> list[tuple[int, str, bool]]:
    """(line, imported module, whether a comment on that line or the one above says why) for every
    import inside a function of `source`."""
    lines = source.splitlines()
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if in_function and isinstance(child, (ast.Import, ast.ImportFrom)):
                targets = ([alias.name for alias in child.names] if isinstance(child, ast.Import)
                           else [_resolve(module, is_package, child)])
                said = "#" in lines[child.end_lineno - 1] or lines[child.lineno - 2].strip().startswith("#")
                found.extend((child.lineno, target, said) for target in targets)
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(ast.parse(source), False)
    return found


def whale_local_imports() -> dict[str, list[tuple[int, str, bool]]]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        out[module] = function_local_imports(path.read_text(), module, path.name == "__init__.py")
    return out


def test_the_finder_sees_imports_inside_functions_only():
    source = ("import os\n\ndef f():\n    import json\n    # lazy: heavy\n    from whale.run import x\n"
              "    class C:\n        def g(self):\n            from . import errors  # why\n")
    assert function_local_imports(source, "whale.cli") == [
        (4, "json", False), (6, "whale.run", True), (9, "whale", True)]


def test_whale_modules_are_imported_at_the_top_except_the_listed_lazy_ones():
    """A new `from whale... import` inside a function fails here: move it to the top of its module
    (the import graph has no cycle, so it can go there), or list it above with its reason."""
    lazy = {(module, target) for module, found in whale_local_imports().items()
            for _, target, _ in found if target == "whale" or target.startswith("whale.")}
    assert lazy - set(LAZY_WHALE_IMPORTS) == set(), "function-local whale imports not in LAZY_WHALE_IMPORTS"
    assert set(LAZY_WHALE_IMPORTS) - lazy == set(), "LAZY_WHALE_IMPORTS lists imports that are gone"


def test_every_import_left_inside_a_function_says_why():
    """Optional extras (ray, vllm, verifiers, ...), readers of optional file types, and heavy
    modules kept off light paths each carry a comment with the reason on the import's line or the
    line above."""
    silent = [f"{module}:{line} {target}" for module, found in whale_local_imports().items()
              for line, target, said in found if not said]
    assert silent == [], "function-local imports without a reason comment:\n" + "\n".join(silent)
