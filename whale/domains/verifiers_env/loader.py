"""Loading a verifiers environment the way published environments are loaded, and checking it.

`domain.options.env` names a `load_environment`-style factory, "package.module:function" (a
published environment is an installed module whose factory is `load_environment`, so the module
name alone means "module:load_environment"); `domain.options.args` are its keyword arguments.
The environment must be a `SingleTurnEnv` or a `ToolEnv` of the classic verifiers API, which
verifiers 0.1 to 0.3 expose (0.4 keeps only its new v1 stack); WHALE drives it through the
internals of 0.3 (`init_state`, `Rubric.score_group`), so the extra pins `verifiers>=0.3.1,<0.4`.

Loaded environments are cached per (spec, args) and process: the grading processes load their
own copy once, then score every episode with it.
"""

from __future__ import annotations

import functools
import importlib
import json
from typing import Any


class VerifiersEnvError(ValueError):
    """A verifiers environment WHALE cannot use; the message names the environment."""


def verifiers_module():
    try:
        import verifiers  # optional extra: imported only for this domain

        return verifiers
    except ImportError:
        raise VerifiersEnvError("domain verifiers needs the verifiers package (0.3.x): "
                                "pip install 'whale-opt[verifiers]'") from None


def split_spec(spec: str) -> tuple[str, str]:
    if not isinstance(spec, str) or not spec.strip():
        raise VerifiersEnvError("domain verifiers needs domain.options.env: 'package.module:load_environment'")
    module, _, func = spec.strip().partition(":")
    return module, func or "load_environment"


@functools.lru_cache(maxsize=8)
def _load_cached(spec: str, args_json: str):
    vf = verifiers_module()
    module_name, func_name = split_spec(spec)
    try:
        factory = getattr(importlib.import_module(module_name), func_name)
    except (ImportError, AttributeError) as e:
        raise VerifiersEnvError(f"verifiers env {spec!r} could not be imported: {e}") from None
    try:
        env = factory(**json.loads(args_json))
    except Exception as e:  # noqa: BLE001 - the environment's own code: report, do not crash
        raise VerifiersEnvError(f"verifiers env {spec!r}: load_environment raised {type(e).__name__}: {e}") from None
    if not isinstance(env, (vf.SingleTurnEnv, vf.ToolEnv)):
        raise VerifiersEnvError(f"verifiers env {spec!r} returned {type(env).__name__}; WHALE supports "
                                "SingleTurnEnv and ToolEnv environments")
    if isinstance(env, vf.StatefulToolEnv):
        raise VerifiersEnvError(f"verifiers env {spec!r} is a StatefulToolEnv (tools that read rollout "
                                "state); WHALE supports SingleTurnEnv and ToolEnv environments")
    return env


def load_environment(spec: str, args: dict[str, Any]):
    return _load_cached(spec, json.dumps(args or {}, sort_keys=True))


def dataset_rows(env, spec: str, which: str) -> list[dict[str, Any]]:
    """The rows of `env.dataset` or `env.eval_dataset`, each checked for a usable `prompt`."""
    try:
        data = env.build_dataset() if which == "dataset" else env.build_eval_dataset()
    except Exception as e:  # noqa: BLE001 - verifiers formats the rows here and raises on bad ones
        raise VerifiersEnvError(f"verifiers env {spec!r}: {which} rows lack 'prompt' (or 'question' to build "
                                f"it from); verifiers raised {type(e).__name__}: {e}") from None
    if data is None:
        return []
    rows = [dict(r) for r in data]
    for n, row in enumerate(rows):
        prompt = row.get("prompt")
        if not isinstance(prompt, list) or not prompt or not all(isinstance(m, dict) and "role" in m for m in prompt):
            raise VerifiersEnvError(f"verifiers env {spec!r}: {which} row {n} lacks 'prompt' "
                                    "(a list of chat messages); got columns " + ", ".join(sorted(row)))
        if isinstance(row.get("info"), str):
            row["info"] = json.loads(row["info"] or "{}")
    return rows


def tool_schemas(env) -> list[dict[str, Any]]:
    """The environment's tools as OpenAI-style schemas (what `llm(..., tools=...)` takes)."""
    return [{"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": t.parameters}} for t in (env.tool_defs or [])]
