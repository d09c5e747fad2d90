"""Candidate validation: cheap static checks first, then a smoke run in the sandbox.

Evaluating a candidate costs one rollout per harness-split problem, so everything that can be
decided from the file alone is decided first (size, syntax, the harness contract (docs/design.md, 4.1), imports,
the prompt-only rule, leaked harness-split literals). Only then does a short smoke run catch what
only execution shows (a NameError in `run`, a crash on import of an allowed module). The sandbox
enforces the real limits; these checks exist to fail fast with a readable reason, which goes
into the archive so the next proposer can learn from it.
"""

from __future__ import annotations

import ast
import re
import sys
from typing import Any

from whale.config import Config

PROMPT_NAMES = ("SYSTEM_PROMPT", "USER_PROMPT")
_QUESTION_LITERAL_MIN = 24  # a literal this long found inside a harness question is question-conditional
_GOLD_MIN = 4  # shorter gold strings ("5", "e2e4") collide with ordinary literals


def _module_string_constants(tree: ast.Module) -> dict[str, ast.stmt]:
    found = {}
    for node in tree.body:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    found[target.id] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            found[node.target.id] = node
    return found


def _import_roots(tree: ast.Module) -> list[tuple[str, int]]:
    roots = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots += [(alias.name.split(".")[0], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            roots.append(("." * node.level + (node.module or "").split(".")[0], node.lineno))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            fn = node.func
            name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else ""
            if name in ("__import__", "import_module"):
                roots.append((node.args[0].value.split(".")[0], node.lineno))
    return roots


def _check_contract(tree: ast.Module) -> str | None:
    runs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == "run"]
    if not runs:
        return "defines no top-level function run(env, llm)"
    run = runs[-1]
    if isinstance(run, ast.AsyncFunctionDef):
        return "run must be a plain function, not async"
    positional = run.args.posonlyargs + run.args.args
    required = len(positional) - len(run.args.defaults)
    if len(positional) < 2 or required > 2 or any(d is None for d in run.args.kw_defaults):
        return "run must take exactly two positional parameters: run(env, llm)"
    return None


def check_prompt_constants(tree: ast.Module) -> str | None:
    """Prompt-only search edits SYSTEM_PROMPT and USER_PROMPT, so there both must be string literals.

    Everywhere else a harness needs only `run(env, llm)` (docs/design.md, 4.1): the constants are a
    convention h0 follows, not part of the contract.
    """
    consts = _module_string_constants(tree)
    for name in PROMPT_NAMES:
        node = consts.get(name)
        if node is None:
            return f"prompt-only search needs a module-level {name} string constant; this file defines none"
        if not (isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
            return f"prompt-only search needs {name} to be a string literal"
    return None


def prompt_only_search(cfg: Config) -> bool:
    """Whether this config's harness search may edit only the prompt constants."""
    return cfg.harness.prompt_only or cfg.schedule.kind == "prompt_only"


def _check_imports(tree: ast.Module, cfg: Config) -> str | None:
    allowed = set(sys.stdlib_module_names) | {p.replace("-", "_") for p in cfg.runner.sandbox.extra_packages}
    for root, line in _import_roots(tree):
        if root.startswith("."):
            return f"line {line}: relative import '{root}' (a harness is a single file)"
        if root == "whale":
            return f"line {line}: imports 'whale' (harnesses never see the product package)"
        if root not in allowed:
            return (f"line {line}: imports '{root}', which is neither standard library nor in "
                    f"runner.sandbox.extra_packages")
    return None


def _prompt_skeleton(tree: ast.Module) -> str:
    """ast.dump with the prompt values and the module docstring blanked out."""
    body = list(tree.body)
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    out = []
    for node in body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id in PROMPT_NAMES for t in targets):
            node = ast.Assign(targets=targets, value=ast.Constant("<prompt>"), lineno=0)
        out.append(ast.dump(node))
    return "\n".join(out)


def check_prompt_only(source: str, base_source: str) -> str | None:
    """None when `source` differs from `base_source` only in SYSTEM_PROMPT/USER_PROMPT (and docstring)."""
    try:
        base = ast.parse(base_source)
    except SyntaxError as e:
        return f"prompt-only: the base harness does not parse ({e})"
    if _prompt_skeleton(ast.parse(source)) != _prompt_skeleton(base):
        return "prompt-only mode: the candidate changes code other than SYSTEM_PROMPT and USER_PROMPT"
    return None


def _norm(text: str) -> str:
    return " ".join(str(text).lower().split())


def _gold_strings(answer: Any) -> list[str]:
    if isinstance(answer, str):
        return [answer]
    if isinstance(answer, (list, tuple)):
        out = [a for a in answer if isinstance(a, str)]
        if out and len(out) == len(answer):
            out.append(" ".join(out))  # a chess line or a multi-part answer, as one string
        return out
    return [] if answer is None else [str(answer)]


def _string_literals(tree: ast.AST) -> set[str]:
    return {_norm(n.value) for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def check_leaks(source: str, problems: list, base_source: str | None = None) -> str | None:
    """Reject literals that embed a harness-split question (or a long piece of one) or a gold answer.

    A cheap guard for when traces show gold: it catches copy-paste lookup tables, not a
    determined adversary. Literals the parent already had are exempt (h0's own examples).
    """
    literals = _string_literals(ast.parse(source))
    if base_source:
        try:
            literals -= _string_literals(ast.parse(base_source))
        except SyntaxError:
            pass
    literals = {s for s in literals if s}
    for p in problems:
        q = _norm(p.question)
        for lit in literals:
            if (q and q in lit) or (len(lit) >= _QUESTION_LITERAL_MIN and lit in q):
                return f"embeds text of harness-split question {p.id} as a literal ({lit[:60]!r})"
        for gold in _gold_strings(p.answer):
            g = _norm(gold)
            if len(g) >= _GOLD_MIN and g in literals:
                return f"embeds the gold answer of harness-split problem {p.id} as a literal"
    return None


def static_check(source: str, cfg: Config, *, base_source: str | None = None, prompt_only: bool = False,
                 harness_problems: list | None = None) -> str | None:
    """Every check that needs no execution; returns the reason for rejection or None.

    The prompt constants are required when `prompt_only` is asked for or the config's search is
    prompt-only (so `harness.initial` of a prompt-only run is checked for them too).
    """
    size = len(source.encode())
    if size == 0:
        return "empty file"
    if size > cfg.harness.max_file_bytes:
        return f"file is {size} bytes, above harness.max_file_bytes={cfg.harness.max_file_bytes}"
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        return f"syntax error: line {e.lineno}: {e.msg}"
    for check in (_check_contract(tree), _check_imports(tree, cfg)):
        if check:
            return check
    if prompt_only or prompt_only_search(cfg):
        reason = check_prompt_constants(tree)
        if reason:
            return reason
    if prompt_only:
        if base_source is None:
            raise ValueError("prompt-only validation needs base_source")
        reason = check_prompt_only(source, base_source)
        if reason:
            return reason
    if cfg.domain.show_gold_in_traces and harness_problems:
        reason = check_leaks(source, harness_problems, base_source)
        if reason:
            return reason
    return None


def _last_lines(text: str, n: int = 3) -> str:
    lines = [line for line in str(text).strip().splitlines() if line.strip()]
    return " | ".join(lines[-n:])[-500:]


def validate_candidate(source: str, domain, cfg: Config, runner, *, base_source: str | None = None,
                       prompt_only: bool = False, harness_problems: list | None = None,
                       on_rollouts=None) -> tuple[bool, str]:
    """(ok, reason). Static checks, then a smoke run of cfg.harness.smoke_examples episodes.

    The smoke run goes through the same RolloutRunner as everything else (purpose="smoke", so
    its rollouts are counted); a candidate is rejected only when every smoke episode errored,
    because a single failed episode is a legitimate outcome of a stochastic model. `runner=None`
    runs the static checks only; `on_rollouts(purpose, trajectories)` lets the caller count them.
    """
    reason = static_check(source, cfg, base_source=base_source, prompt_only=prompt_only,
                          harness_problems=harness_problems)
    if reason:
        return False, reason
    if runner is None or cfg.harness.smoke_examples <= 0:
        return True, "static checks passed (no smoke run)"
    problems = harness_problems if harness_problems is not None else domain.load_splits()["harness"]
    problems = list(problems)[: cfg.harness.smoke_examples]
    if not problems:
        return True, "static checks passed (no problems for a smoke run)"
    trajs = runner.run(source, problems, 1, harness_id="smoke", seed=cfg.seed, purpose="smoke")
    if on_rollouts is not None:
        on_rollouts("smoke", trajs)
    errors = [t.error for t in trajs if t.error]
    if trajs and len(errors) == len(trajs):
        return False, f"smoke run: all {len(trajs)} episodes failed: {_last_lines(errors[0])}"
    note = f"; smoke errors {len(errors)}/{len(trajs)}: {_last_lines(errors[0])}" if errors else ""
    return True, f"ok (smoke {len(trajs) - len(errors)}/{len(trajs)} episodes ran{note})"


def parse_docstring_fields(source: str) -> dict[str, str]:
    """Read 'Hypothesis:', 'Mechanism:' and 'Parent:' lines from a candidate's module docstring."""
    try:
        doc = ast.get_docstring(ast.parse(source)) or ""
    except SyntaxError:
        doc = ""
    fields = {}
    for key in ("hypothesis", "mechanism", "parent"):
        m = re.search(rf"^\s*{key}\s*:\s*(.+?)\s*$", doc, flags=re.IGNORECASE | re.MULTILINE)
        if m:
            fields[key] = m.group(1)
    if "hypothesis" not in fields and doc.strip():
        fields["hypothesis"] = doc.strip().split("\n\n")[0].replace("\n", " ")[:300]
    return fields
