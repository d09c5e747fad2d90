"""Parse tool calls out of generated text into OpenAI-style dicts.

Why parse text: in-process backends see only tokens. Small open models (Qwen, SmolLM, Hermes
fine-tunes) write tool calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
blocks, or, when the template says nothing about tags, as a bare JSON object. Harnesses get the
same `tool_calls` shape from every engine, and the raw text (with the markup) stays the completion,
so training rows keep exactly what was sampled.
"""

from __future__ import annotations

import json
import re
from typing import Any

_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


def _first_json(text: str) -> Any:
    """The JSON value that `text` is, or the first object starting at a '{' (trailing text allowed)."""
    text = text.strip()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    start = text.find("{")
    if start < 0:
        return None
    try:
        value, _ = json.JSONDecoder().raw_decode(text[start:])
        return value
    except json.JSONDecodeError:
        return None


def _as_call(obj: Any) -> tuple[str, str] | None:
    """(name, arguments-as-JSON-string) when `obj` looks like a function call, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"].strip():
        return None
    if "arguments" in obj:
        args = obj["arguments"]
    elif "parameters" in obj:  # Llama-3.x style
        args = obj["parameters"]
    else:
        return None
    if isinstance(args, str):
        try:  # already a JSON string (OpenAI style): normalise it
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return obj["name"].strip(), json.dumps(args, ensure_ascii=False)


def parse_tool_calls(text: str) -> list[dict[str, Any]] | None:
    """OpenAI-style tool calls found in `text`, or None when there are none.

    Recognised: one or more `<tool_call>{json}</tool_call>` blocks (an unterminated last block is
    accepted, since generation may stop at the closing tag), otherwise a bare JSON object (or a
    list of objects), optionally inside a ```json fence, with `name` and `arguments` (or
    `parameters`). Blocks that do not parse are skipped.
    """
    calls: list[tuple[str, str]] = []
    if "<tool_call>" in text:
        for block in _BLOCK.findall(text):
            call = _as_call(_first_json(block))
            if call:
                calls.append(call)
    else:
        body = text.strip()
        fence = _FENCE.match(body)
        if fence:
            body = fence.group(1)
        value = _first_json(body)
        for obj in value if isinstance(value, list) else [value]:
            call = _as_call(obj)
            if call:
                calls.append(call)
    if not calls:
        return None
    return [
        {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": args}}
        for i, (name, args) in enumerate(calls)
    ]
