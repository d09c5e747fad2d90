"""Math verifier: the answer is the last `\\boxed{...}` of the submitted text, checked with math-verify.

Why strict boxed: it is the rule the paper uses for math (DAPO's strict `\\boxed{}` match) and it
separates "could not format an answer" from "answered wrongly". `lenient_last_number` (a domain
option) also accepts the last number of the text, for small models that never box.

Why the numeric-literal guard: math-verify evaluates expressions, so `\\boxed{37+48}` equals 85.
On our arithmetic problems a model (or harness) could earn reward by copying the question into the
box, and RSFT would happily learn that. When the gold is a number we therefore require the boxed
answer to be a number too (`85`, `-3`, `0.75`, `3/4`, `\\frac{3}{4}`, `1,000`, `$85`, `85 apples`).

Why the care with timeouts: math-verify's timeouts use SIGALRM, which only works in a process's
main thread (elsewhere it raises). The runner grades in worker processes; in any other thread we
call it without timeouts. Nothing raised inside grading escapes: a malformed answer scores 0.
"""

from __future__ import annotations

import re
import threading
from typing import Any

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
from math_verify.errors import TimeoutException

from whale.domains.base import Problem

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BOXED_SPACE = re.compile(r"\\boxed +([^\s$]+)")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_NUMERIC_LITERAL = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)(?:/\d+)?")
_FRAC_LITERAL = re.compile(r"-?\\[dt]?frac(?:\{\d+\}\{\d+\}|\d\d)")
MAX_ANSWER_CHARS = 20_000  # only the tail of a runaway completion is looked at
MAX_BOXED_CHARS = 500


def last_boxed(text: str) -> str | None:
    """Content of the last well-formed `\\boxed{...}` (balanced braces), or of `\\boxed 42`."""
    best: tuple[int, str] | None = None
    for m in _BOXED.finditer(text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
            i += 1
        if depth == 0:
            best = (m.start(), text[m.end() : i - 1])
    for m in _BOXED_SPACE.finditer(text):
        if best is None or m.start() > best[0]:
            best = (m.start(), m.group(1))
    return None if best is None else best[1].strip()


def last_number(text: str) -> str | None:
    found = _NUMBER.findall(text)
    return found[-1].replace(",", "") if found else None


def numeric_literal(text: str) -> str | None:
    """`text` reduced to a plain number (or simple fraction) if it is one, else None.

    Strips what is decoration, not arithmetic: dollar signs, `\\text{units}`, trailing words,
    thousands separators, a percent sign, spacing commands and a final period.
    """
    s = text.strip()
    s = re.sub(r"\\(?:text|mathrm|textbf|mbox)\s*\{[^{}]*\}", " ", s)
    for junk in ("\\$", "$", "\\!", "\\,", "\\;", "\\ ", "\\left", "\\right", "{,}", "\\%", "%"):
        s = s.replace(junk, "" if junk != "{,}" else ",")
    s = re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", s)
    s = re.sub(r"[A-Za-z\s]+\.?$", "", s).strip().rstrip(".")
    s = s.replace(" ", "")
    if _NUMERIC_LITERAL.fullmatch(s) or _FRAC_LITERAL.fullmatch(s):
        return s
    return None


def _wrap_gold(gold: str) -> str:
    """math-verify only extracts LaTeX inside a math environment, so bare golds get `$...$`."""
    if "$" in gold or "\\boxed" in gold or "\\[" in gold or "\\(" in gold:
        return gold
    return f"${gold}$"


def _normalize_text(s: str) -> str:
    return re.sub(r"\s+", " ", s.strip().strip("$").strip()).lower()


def _verify(gold: str, pred: str) -> bool:
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold_cfg = [LatexExtractionConfig(), ExprExtractionConfig()]
    pred_cfg = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    gold_parsed = parse(_wrap_gold(gold), extraction_config=gold_cfg, parsing_timeout=timeout)
    if not gold_parsed:  # a gold math-verify cannot read (e.g. a word): exact text match
        return _normalize_text(gold) == _normalize_text(pred)
    pred_parsed = parse("\\boxed{" + pred + "}", extraction_config=pred_cfg, parsing_timeout=timeout)
    if not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout))


def grade_answer(gold: Any, answer: Any, lenient_last_number: bool = False) -> float:
    """1.0 if the submitted text's final answer equals `gold`, else 0.0. Never raises."""
    try:
        if answer is None or gold is None:
            return 0.0
        text = str(answer)[-MAX_ANSWER_CHARS:]
        pred = last_boxed(text)
        if pred is None and lenient_last_number:
            pred = last_number(text)
        if not pred or len(pred) > MAX_BOXED_CHARS:
            return 0.0
        gold = str(gold).strip()
        if numeric_literal(gold) is not None:
            # A numeric gold needs a numeric answer (see module docstring); `x = 5` counts as 5.
            pred = numeric_literal(pred.rsplit("=", 1)[-1])
            if pred is None:
                return 0.0
        return 1.0 if _verify(gold, pred) else 0.0
    except (Exception, TimeoutException):
        return 0.0


def grade_math(problem: Problem, answer: Any, lenient_last_number: bool = False) -> float:
    """The domain grader: module-level so it pickles into grader worker processes."""
    return grade_answer(problem.answer, answer, lenient_last_number)
