"""Source edits of a harness file, used by the mutation proposer (harness/mutation.py).

Why apart: these functions know Python source and the harness contract (a top-level `run`,
SYSTEM_PROMPT / USER_PROMPT literals, named int constants), not which mechanism to try or why;
the proposer composes them. Every edit works on the text through `ast` line numbers, so comments
and layout of the parent survive, and returns None when the parent lacks the expected shape
(the mechanism is then skipped, not forced). Every block an edit adds is marked
`# --- mutation: <name> ---` (MARK), which is how a lineage knows what it already has.
"""

from __future__ import annotations

import ast
import re
import string
from typing import Callable

from whale.harness import blocks as B

MARK = "# --- mutation: {} ---"


def has_mutation(source: str, name: str) -> bool:
    return MARK.format(name) in source


def module_assign(tree: ast.Module, name: str) -> ast.stmt | None:
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return node
    return None


def _replace_lines(source: str, start: int, end: int, text: str) -> str:
    """Replace 1-based lines start..end (inclusive) with `text`."""
    lines = source.splitlines(keepends=True)
    return "".join(lines[: start - 1]) + text.rstrip("\n") + "\n" + "".join(lines[end:])


def _literal(value: str) -> str:
    if len(value) <= 80 and "\n" not in value:
        return repr(value)
    parts = [p for p in re.split(r"(?<=\n)", value) if p]
    chunks = []
    for part in parts:
        while len(part) > 90:
            cut = part.rfind(" ", 0, 90) + 1 or 90
            chunks.append(part[:cut])
            part = part[cut:]
        chunks.append(part)
    return "(\n" + "".join(f"    {c!r}\n" for c in chunks) + ")"


def prompt_is_formatted(tree: ast.Module, name: str) -> bool:
    """True when the code calls NAME.format(...) or NAME % ... (so literal braces must be doubled)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "format" and isinstance(node.value, ast.Name) \
                and node.value.id == name:
            return True
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod) and isinstance(node.left, ast.Name) \
                and node.left.id == name:
            return True
    return False


def prompt_fields(value: str) -> set[str]:
    try:
        return {f for _, f, _, _ in string.Formatter().parse(value) if f is not None}
    except ValueError:
        return {"<unparsable>"}


def edit_prompt(source: str, name: str, fn: Callable[[str, bool], str | None]) -> str | None:
    """Set the string constant `name` to fn(old_value, formatted); None when absent or unchanged."""
    tree = ast.parse(source)
    node = module_assign(tree, name)
    if node is None or not (isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
        return None
    new = fn(node.value.value, prompt_is_formatted(tree, name))
    if new is None or new == node.value.value:
        return None
    return _replace_lines(source, node.lineno, node.end_lineno, f"{name} = {_literal(new)}")


def escape_braces(text: str, formatted: bool) -> str:
    return text.replace("{", "{{").replace("}", "}}") if formatted else text


def ensure_import(source: str, module: str) -> str:
    tree = ast.parse(source)
    for node in tree.body:
        if isinstance(node, ast.Import) and any(a.name == module and a.asname is None for a in node.names):
            return source
    body = tree.body
    at = body[0].end_lineno if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) else 0
    lines = source.splitlines(keepends=True)
    return "".join(lines[:at]) + ("\n" if at else "") + f"import {module}\n" + "".join(lines[at:])


def _unique(source: str, base: str) -> str:
    name, i = base, 2
    while re.search(rf"\b{re.escape(name)}\b", source):
        name, i = f"{base}_{i}", i + 1
    return name


def wrap_run(source: str, name: str, block: str, imports: tuple[str, ...] = ()) -> str | None:
    """Rename the top-level `run` and append `block`, which defines the new `run` and calls
    `__INNER__` (the renamed one) with a wrapped env/llm. Shared helpers are added once."""
    tree = ast.parse(source)
    runs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "run"]
    if not runs:
        return None
    inner = _unique(source, f"_run_before_{name}")
    lines = source.splitlines(keepends=True)
    i = runs[-1].lineno - 1
    renamed = re.sub(r"\bdef\s+run\s*\(", f"def {inner}(", lines[i], count=1)
    if renamed == lines[i]:
        return None
    lines[i] = renamed
    out = "".join(lines).rstrip("\n") + "\n"
    if B.HELPERS_MARK not in out:
        out += "\n\n" + B.HELPERS
    out += "\n\n" + MARK.format(name) + "\n" + block.replace("__INNER__", inner).strip("\n") + "\n"
    for module in ("re", *imports):
        out = ensure_import(out, module)
    return out


def base_run(tree: ast.Module, source: str) -> ast.FunctionDef | None:
    """The innermost run: `run` or a renamed `_run_before_*` defined before any mutation block."""
    first_mark = source.find("# --- mutation")
    limit = source.count("\n", 0, first_mark) + 1 if first_mark >= 0 else 10**9
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and (node.name == "run" or node.name.startswith("_run_before_")) \
                and node.lineno < limit:
            return node
    return None


def replace_base_run(source: str, name: str, block: str) -> str | None:
    """Replace the body of the innermost run with `block` (a def named __NAME__)."""
    tree = ast.parse(source)
    node = base_run(tree, source)
    if node is None:
        return None
    start = min([node.lineno] + [d.lineno for d in node.decorator_list])
    text = MARK.format(name) + "\n" + block.replace("__NAME__", node.name).strip("\n")
    out = _replace_lines(source, start, node.end_lineno, text)
    if B.HELPERS_MARK not in out:
        out = out.rstrip("\n") + "\n\n\n" + B.HELPERS
    return ensure_import(out, "re")


def bump_constants(source: str, pattern: str, fn: Callable[[int], int]) -> str | None:
    """Apply fn to every module-level int constant whose NAME matches `pattern`."""
    tree = ast.parse(source)
    out, changed = source, False
    for node in reversed(tree.body):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
                and re.search(pattern, node.targets[0].id) and isinstance(node.value, ast.Constant) \
                and type(node.value.value) is int:
            out = _replace_lines(out, node.lineno, node.end_lineno, f"{node.targets[0].id} = {fn(node.value.value)}")
            changed = True
    return out if changed else None


def stamp_docstring(source: str, hypothesis: str, mechanism: str, parent: str) -> str:
    """Put Hypothesis/Mechanism/Parent first in the module docstring; older ones become 'Earlier ...'."""
    header = f"Hypothesis: {hypothesis}\nMechanism: {mechanism}\nParent: {parent}\n\n"
    tree = ast.parse(source)
    first = tree.body[0] if tree.body else None
    if first is not None and isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
            and isinstance(first.value.value, str):
        segment = ast.get_source_segment(source, first) or ""
        m = re.match(r'^([rRuU]?)("""|\'\'\')', segment)
        if m:
            body = segment[len(m.group(0)):]
            body = re.sub(r"^(\s*)(Hypothesis|Mechanism|Parent):", lambda x: f"{x.group(1)}Earlier {x.group(2).lower()}:",
                          body, flags=re.MULTILINE)
            head = header if m.group(1) else header.replace("\\", "\\\\")
            return _replace_lines(source, first.lineno, first.end_lineno, m.group(0) + head + body)
        return _replace_lines(source, first.lineno, first.end_lineno, '"""' + header.replace("\\", "\\\\") + '"""')
    return '"""' + header.replace("\\", "\\\\") + '"""\n\n' + source
