"""Tool calls in chat completions: which format the served model writes, and reading it back.

The format is the model's, read from its own chat template (what it was trained to write), never
guessed from the output:

| the template holds | format | a call in the output |
| --- | --- | --- |
| ``<tool_call>`` | hermes (Qwen2.5, Qwen3, Hermes, ...) | ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, any number |
| ``[TOOL_CALLS]`` | mistral | ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` |
| ``<|python_tag|>`` or a ``tools`` block with ``"parameters"`` | llama3_json (Llama 3.1+) | the whole answer one JSON object ``{"name": ..., "parameters": {...}}`` |

A template without any of these cannot take ``tools`` (the request is refused by name). Text that
does not parse as a call stays content: a malformed call is returned as the text the model wrote.
"""

from __future__ import annotations

import json
import re
import uuid

__all__ = ["tool_format", "parse_tool_calls"]

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def tool_format(chat_template: str | None) -> str | None:
    """The tool-call format of a chat template (module doc), None when it has none."""
    if not chat_template or "tools" not in chat_template:
        return None
    if "<tool_call>" in chat_template:
        return "hermes"
    if "[TOOL_CALLS]" in chat_template:
        return "mistral"
    if "<|python_tag|>" in chat_template or '"parameters"' in chat_template:
        return "llama3_json"
    return None


def _call(name, arguments) -> dict | None:
    if not isinstance(name, str) or not name:
        return None
    if not isinstance(arguments, (dict, str)):
        return None
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": args}}


def _load(text: str):
    try:
        return json.loads(text)
    except (json.JSONDecodeError, ValueError):
        return None


def _hermes(text: str) -> tuple[str | None, list[dict]]:
    calls = []
    for body in _HERMES.findall(text):
        obj = _load(body)
        call = _call(obj.get("name"), obj.get("arguments", {})) if isinstance(obj, dict) else None
        if call is None:
            return text, []  # a malformed call: the text as written
        calls.append(call)
    if not calls:
        return text, []
    content = text[:text.index("<tool_call>")].strip()
    return content or None, calls


def _mistral(text: str) -> tuple[str | None, list[dict]]:
    if "[TOOL_CALLS]" not in text:
        return text, []
    head, _, tail = text.partition("[TOOL_CALLS]")
    objs = _load(tail.strip())
    objs = objs if isinstance(objs, list) else [objs]
    calls = [_call(o.get("name"), o.get("arguments", {})) if isinstance(o, dict) else None
             for o in objs]
    if not calls or None in calls:
        return text, []
    return head.strip() or None, calls


def _llama3(text: str) -> tuple[str | None, list[dict]]:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    obj = _load(body)
    if not isinstance(obj, dict):
        return text, []
    call = _call(obj.get("name"), obj.get("parameters", obj.get("arguments", {})))
    return (text, []) if call is None else (None, [call])


def parse_tool_calls(text: str, fmt: str) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of an answer written in ``fmt``: OpenAI's tool_calls entries
    ({id, type: "function", function: {name, arguments (a JSON string)}}); none found: the text
    as content and []."""
    return {"hermes": _hermes, "mistral": _mistral, "llama3_json": _llama3}[fmt](text)
