"""BRIEF.md: what a proposer is told before it reads the archive.

Meta-Harness's authors found the skill text matters more than iteration count or population size,
so the brief is explicit: the harness contract, the domain, what to read (code and raw traces,
failures first), how to work (diagnose, then prototype, then write), and the rules the released
WHALE and Meta-Harness skills insist on, in our words: one mechanism per candidate, no
parameter-only variants, no dataset-specific or question-conditional code, the exact file
contract, no evaluations and nothing read outside the workspace (the sandbox enforces the last
two for a coding agent; the brief says why, so a strong agent does not waste its turns trying).
The domain's declared hints (harness.domain_hints) get their own section after its description.
"""

from __future__ import annotations

from typing import Any

from whale.config import Config
from whale.domains.base import Domain
from whale.harness.mechanism import hints_in_use

CONTRACT = """\
A harness is ONE Python file that defines

    SYSTEM_PROMPT = "..."          # module-level string literal
    USER_PROMPT = "..."            # module-level string literal
    def run(env, llm):             # play one episode; return nothing, answer through env
        ...

- `llm(messages, *, max_tokens=None, stop=None, choices=None, n=1, tools=None, template_kwargs=None)`
  is the only way to reach the model. `messages` is a list of {"role", "content"} chat messages.
  It returns a Completion: a `str` with `.finish_reason`, `.tool_calls` and `.usage`
  (a list of them when n > 1).
  - `choices=[...]` returns exactly one of the given strings, drawn from the model's own
    probabilities (constrained decoding at sequence level).
  - If the last message has role "assistant", the model continues that text (prefill) and only
    the continuation is returned, e.g. prefill "<answer>" to force the answer format.
  - Sampling temperature/top-k come from the run config; you cannot change them.
- `env` is the episode: `env.question` (str), `env.submit(answer)` (once), plus the domain's
  tools and state attributes described below. Tool errors raise an exception with the reason.
- Budgets per episode (LLM calls, tool calls, tokens, seconds) are enforced outside the harness;
  exceeding one ends the episode with reward 0.
- The harness runs in a sandbox: standard library only{extra}, never `whale`, no network, no
  files of the project. It never sees the gold answer or the grader.
"""

WORKFLOW = """\
1. Read the failures first: in the incoming harness's `traces.jsonl`, the episodes with reward 0.
   For each, find the first step where it went wrong (the prompt the model saw, its completion,
   the parsing of it, a tool result, the submitted answer). Count which failure mode is most
   common; the summary rows and the automatic first read above are a start, not the answer.
2. Read the code of the incoming harness and of the best few in `summary.jsonl`, and what earlier
   candidates tried (their Hypothesis/Mechanism lines and scores): do not repeat a mechanism that
   already failed under these weights unless you can say what was wrong with its implementation.
3. Choose one mechanism per candidate that addresses a failure mode you saw. Where changes come
   from: what the model is shown (instructions, examples, which context or tool result, its
   layout); how answers are produced (several samples and a vote, a check-and-retry step,
   `choices=` or a prefill that fixes the format); how the model's text is turned into an
   answer (extraction, normalisation, fallbacks); how tools are used (which, when, how often,
   what is kept of their results); control flow (steps, early exits, budgets per step).
4. Prototype before you write{prototype}
5. Critique each candidate against the rules below and against the traces, then write it.
6. Finish with a short report (at most 30 lines): per candidate the failure mode, the mechanism
   and why you expect it to help.
"""

RULES = """\
1. Write exactly {n} file(s): `candidates/cand_1.py` ... `candidates/cand_{n}.py` (regular
   files directly in candidates/). Nothing else you write is collected; the workspace is
   deleted when you finish.
2. Each file starts with a module docstring containing the lines
       Hypothesis: <why this should raise the success rate, citing what you saw in traces>
       Mechanism: <the ONE mechanism this candidate changes>
       Parent: <id of the archive harness you started from>
3. One mechanism per candidate, so its effect can be read off the scores.
4. No parameter-only variants: a candidate whose logic differs from its parent only in numbers
   or constants is wasted budget. Change what the harness does.
5. No dataset-specific hacks: no dataset names, no lookup tables of questions or answers, no
   code that branches on the text of particular questions.
6. Read nothing outside your working directory: the archive is all you may read. Never look
   for test or validation data, other runs, or this framework's code; they are not there to
   find, and a candidate tuned to anything but the archive's traces does not generalise.
7. Do not run benchmarks or evaluate candidates (there is no model here to run them with):
   evaluation happens outside, on the harness-search split, after you finish. Do not hand the
   work to sub-agents; write the candidates yourself.
8. Standard library only{extra}; keep the file under {max_bytes} bytes.
9. The model must do the work: a harness whose score barely drops when the model is replaced by
   random output (a null-engine probe) is rejected. Help the model; do not answer for it.
"""

READ = """\
The archive (`{archive}`) holds every earlier candidate; read code and raw traces first:
- `summary.jsonl`: one row per evaluated (candidate, weights version): success_rate,
  mean_llm_calls, mean_tokens, rollouts, errors, mechanism, hypothesis, parent.
- `frontier.json`: the Pareto frontier (success rate up, LLM calls down) per weights version.
- `<id>/harness.py`: the candidate's code. `<id>/meta.json`: parent, hypothesis, status
  (valid / invalid / duplicate) and the reason an invalid one was rejected.
- `<id>/scores.json`: scores per weights version.
- `<id>/traces.jsonl`: every episode on the search split: each model call (messages,
  completion), each tool call, the answer, reward, error. Compare failures of the best
  harness with successes; `grep '"reward": 0.0'` finds the failures.
Only scores measured under the current weights version (`{version}`) are comparable.
"""


def make_brief(domain: Domain, cfg: Config, n: int, *, weights_version: str, incoming_id: str,
               frontier: list[dict[str, Any]] | None = None, prompt_only: bool = False,
               base_source: str | None = None, archive_path: str = "archive/",
               diagnoses: dict[str, str] | None = None) -> str:
    """`diagnoses` (harness id -> diagnose.py's text) is the first read of the traces, the same
    one the offline mutation proposer acts on; the proposer should check it against the traces.
    The domain's hints (`hints_section`) follow its description when `harness.domain_hints` is on."""
    extra = cfg.runner.sandbox.extra_packages
    extra_text = f" plus {', '.join(extra)}" if extra else ""
    b = cfg.domain.budget
    parts = [
        f"# Harness search brief: domain `{domain.name}`\n\n",
        "You are improving the harness (the program around a language model) for this task. "
        "Read the archive, find why episodes fail, and write new candidate harnesses.\n",
        "\n## The harness contract\n\n", CONTRACT.replace("{extra}", extra_text),
        f"Budgets here: {b.llm_calls} LLM calls, {b.tool_calls} tool calls, {b.tokens} tokens, "
        f"{b.seconds:g} s per episode; default max_tokens per call {cfg.sampling.max_tokens}, "
        f"at most {cfg.sampling.max_tokens_cap}.\n",
        "\n## The domain\n\n", domain.brief.strip() + "\n",
        *hints_section(domain, cfg),
        "\n## What to read\n\n", READ.format(archive=archive_path, version=weights_version),
        "\n## Where things stand\n\n",
        f"- Current weights version: `{weights_version}`; the incoming harness is `{incoming_id}`.\n",
    ]
    if weights_version != "base":
        parts.append("- These weights were fine-tuned in this run on rollouts of the harnesses before them and have "
                     "adapted to the layout of the context those showed the model: changes that keep it (which "
                     "passage or result is shown, sampling and voting, answer parsing, retries) are safer than "
                     "changes to the prompt text or the format of tool results (measured on search QA: three "
                     "passages instead of one cost a trained model half its accuracy).\n")
    for p in (frontier or [])[:8]:
        parts.append(f"- frontier: `{p['id']}` success_rate={p['success_rate']:.3f} "
                     f"mean_llm_calls={p['mean_llm_calls']:.2f}\n")
    if diagnoses:
        parts.append("\n## What the traces show (automatic first read; verify it in traces.jsonl)\n\n")
        for cid, text in diagnoses.items():
            parts.append(f"- `{cid}` under `{weights_version}`: {text}\n")
        parts.append("Fix the most common failure mode first, unless the traces show it is not the real cause.\n")
    prototype = (" (chat proposer: there is no shell, so check the code by reading it against the traces)."
                 if cfg.harness.proposer == "chat" else
                 ": run your harness with `python3` (standard library)\n   on a stand-in `env` and an `llm` that "
                 "replays completions recorded in traces.jsonl, for a failed\n   and a passed episode; it must run "
                 "and reach env.submit. Keep such scratch files outside\n   candidates/ (e.g. in /tmp).")
    parts += ["\n## How to work\n\n", WORKFLOW.format(prototype=prototype)]
    parts += ["\n## Rules\n\n", RULES.format(n=n, extra=extra_text, max_bytes=cfg.harness.max_file_bytes)]
    if prompt_only:
        parts += [
            "\n## Prompt-only mode\n\n",
            "You may change ONLY the values of SYSTEM_PROMPT and USER_PROMPT (and the module "
            "docstring). Every other line must stay exactly as in this base harness; anything else "
            "is rejected by an AST comparison. Keep any format placeholders the code fills in.\n\n",
            "```python\n" + (base_source or "").rstrip() + "\n```\n",
        ]
    return "".join(parts)


# ----- the domain's hints (harness.domain_hints) -------------------------------------------------
def hints_section(domain: Domain, cfg: Config) -> list[str]:
    """The domain's declared knowledge as text, the same hints the offline proposer applies as
    "hint: <name>" mechanisms; nothing when `harness.domain_hints` is off or the domain has none."""
    hints = hints_in_use(domain, cfg.harness.domain_hints)
    if not hints.text and not hints.mechanisms:
        return []
    parts = ["\n## Domain hints (what is known to help on this task)\n\n"]
    if hints.text:
        parts.append(hints.text.strip() + "\n")
    if hints.mechanisms:
        parts.append("Mechanisms that worked here before (one per candidate, if the traces call for it):\n")
        parts += [f"- {m.name}: {m.hypothesis}\n" for m in hints.mechanisms if not m.name.startswith("system_prompt")]
    return parts
