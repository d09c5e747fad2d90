"""Search-QA verifiers: exact match (default), bounded sub-span match, and an optional LLM judge.

- `em` is Search-R1's `qa_em.py`: normalise (lower case, drop `string.punctuation`, drop the
  articles a/an/the, collapse whitespace) and compare with every gold alias. The graded text is
  the last *innermost* `<answer>...</answer>` of what was submitted (WHALE's rule); if the
  submission contains an answer tag but no complete pair, it scores 0; with no tag at all the
  whole submission is the answer.
- `subspan` is lenient but bounded: the answer may be at most `max(5, words in the alias)` words
  long and must contain a gold alias as whole words. Unbounded containment ("SubEM") rewards
  pasting the whole passage, the reward hack the WHALE authors removed; the bound keeps it to
  one entity.
- `judge` asks an OpenAI-compatible chat model whether the answer means a gold alias (temperature
  0, 3 tries), and falls back to EM when the endpoint fails. EM-correct answers skip the call.

Graders are module-level functions (or `functools.partial`s of them) so the runner can pickle
them into its grading processes.
"""

from __future__ import annotations

import json
import os
import re
import string
import time
import urllib.request
from typing import Any

from whale.domains.base import DataError, Problem

GRADERS = ("em", "subspan", "judge")
SUBSPAN_MAX_WORDS = 5
_ANSWER = re.compile(r"<answer>((?:(?!<answer>).)*?)</answer>", re.DOTALL)
_PUNCT = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """Search-R1's normalisation, in its order: lower, punctuation, articles, whitespace."""
    text = "".join(ch for ch in str(text).lower() if ch not in _PUNCT)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def extract_answer(submitted: str | None) -> str | None:
    """The last innermost <answer>…</answer>; the whole text if no tag; None if tags are broken."""
    if submitted is None:
        return None
    matches = _ANSWER.findall(submitted)
    if matches:
        return matches[-1]
    if "<answer>" in submitted or "</answer>" in submitted:
        return None
    return submitted


def gold_aliases(problem: Problem) -> list[str]:
    gold = problem.answer
    aliases = [gold] if isinstance(gold, str) else list(gold or [])
    return [n for n in (normalize_answer(a) for a in aliases) if n]


def grade_em(problem: Problem, answer: str | None) -> float:
    pred = extract_answer(answer)
    if pred is None:
        return 0.0
    return 1.0 if normalize_answer(pred) in gold_aliases(problem) else 0.0


def grade_subspan(problem: Problem, answer: str | None) -> float:
    pred = extract_answer(answer)
    if pred is None:
        return 0.0
    words = normalize_answer(pred).split()
    padded = f" {' '.join(words)} "
    for gold in gold_aliases(problem):
        if len(words) <= max(SUBSPAN_MAX_WORDS, len(gold.split())) and f" {gold} " in padded:
            return 1.0
    return 0.0


JUDGE_PROMPT = """You grade answers to a factual question.
Question: {question}
Gold answer(s): {gold}
Predicted answer: {pred}
Does the predicted answer name the same entity or value as a gold answer? A vague, partial, or
multi-candidate answer is wrong. Reply with exactly one word: yes or no."""


def grade_judge(problem: Problem, answer: str | None, *, model: str, base_url: str,
                api_key_env: str = "OPENAI_API_KEY", timeout_s: float = 30.0, retries: int = 3) -> float:
    """LLM judge with EM fallback. The key is read from the environment at call time, never pickled."""
    em = grade_em(problem, answer)
    pred = extract_answer(answer)
    if em == 1.0 or pred is None or not pred.strip():
        return em
    gold = problem.answer if isinstance(problem.answer, str) else " | ".join(map(str, problem.answer))
    prompt = JUDGE_PROMPT.format(question=problem.question, gold=gold, pred=pred.strip()[:300])
    body = json.dumps({"model": model, "temperature": 0, "max_tokens": 4,
                       "messages": [{"role": "user", "content": prompt}]}).encode()
    headers = {"Content-Type": "application/json"}
    key = os.environ.get(api_key_env)
    if key:
        headers["Authorization"] = f"Bearer {key}"
    url = base_url.rstrip("/") + "/chat/completions"
    for attempt in range(retries):
        try:
            req = urllib.request.Request(url, data=body, headers=headers)
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                reply = json.loads(resp.read().decode("utf-8"))
            verdict = str(reply["choices"][0]["message"]["content"]).strip().lower()
            if verdict.startswith("yes"):
                return 1.0
            if verdict.startswith("no"):
                return 0.0
        except Exception:  # noqa: BLE001 - any endpoint failure falls back to EM below
            pass
        if attempt + 1 < retries:
            time.sleep(0.5 * (attempt + 1))
    return em


def judge_settings(judge_model: str | None, options: dict[str, Any]) -> dict[str, Any]:
    """Where the judge lives: options.judge_base_url, else $WHALE_JUDGE_BASE_URL, else $OPENAI_BASE_URL."""
    if not judge_model:
        raise DataError("searchqa: grader 'judge' needs domain.judge_model (e.g. gpt-4o-mini)")
    base_url = (options.get("judge_base_url") or os.environ.get("WHALE_JUDGE_BASE_URL")
                or os.environ.get("OPENAI_BASE_URL") or "https://api.openai.com/v1")
    return {"model": judge_model, "base_url": base_url,
            "api_key_env": options.get("judge_api_key_env", "OPENAI_API_KEY"),
            "timeout_s": float(options.get("judge_timeout_s", 30.0))}
