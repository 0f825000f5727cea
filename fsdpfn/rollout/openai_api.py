"""OpenAI's API on a RolloutEngine: /v1/models, /v1/completions, /v1/chat/completions, so the
``openai`` client and agent frameworks can drive rollouts.

Completions: ``prompt`` a string, a token-id list, or a list of either (one choice list per
prompt, n each, in order; the prompts run as one batch, as /generate runs them: max_tokens
capped at what the longest leaves, a seed's draws different for each prompt, a prompt's errors
named "prompt[i]"); ``max_tokens`` (default 16), ``temperature``, ``top_p``, ``n``,
``stop``, ``seed``, ``frequency_penalty``, ``presence_penalty``, ``logprobs`` (an int N >= 0:
choices[].logprobs {tokens, token_logprobs, top_logprobs (null for 0, else per token a dict
text -> logprob of its N best tokens, best first; a token whose text a better one already keys,
as byte pieces that decode to the same "\ufffd", is keyed "token_id:<id>", vLLM's form for a
token as its id, so the dict always holds the N best and each text maps to its best token),
text_offset}: every sampled token's, a stop string's tokens included, which ``text`` cuts and
``token_ids`` keep for training). Chat: ``messages`` (roles system, developer, user, assistant,
tool; content a string or a list of text parts, joined by newlines; none only for an assistant
message with tool_calls) rendered by the model's chat template; ``max_tokens`` or ``max_completion_tokens``
(default: what fits the context); ``logprobs: true`` (and ``top_logprobs``):
choices[].logprobs.content [{token, logprob, bytes (the token's own, byte pieces included),
top_logprobs}]. As in
SGLang and vLLM, ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids`` and ``skip_special_tokens`` are accepted (the openai client's ``extra_body``),
and SGLang's ``rid`` (a string, or one per choice), which /abort_request names.
Tools: ``tools`` (OpenAI's function tools) are rendered by the model's own chat template and the
calls read back from the answer in the model's own format (fsdpfn.rollout.tool_calls): the
choice's message gets ``tool_calls`` and finish_reason "tool_calls", its content the text before
the first call (vLLM's rule); a call is returned as the model wrote it, declared in ``tools`` or
not (as vLLM does: the agent checks the name). ``parallel_tool_calls: false`` keeps the first call
(vLLM's rule; ``token_ids`` still hold every token sampled). ``tool_choice`` "auto" or "none";
"required" and a named function (constrained decoding) are refused by name. History messages
follow OpenAI's shapes: an assistant's ``tool_calls`` [{id, type, function: {name,
arguments}}], a tool message's ``tool_call_id``.
``stream: true`` (both): the answer as OpenAI's server-sent chunks once it is generated (per
choice one chunk with the whole text, or content delta, and its log-probs, then one with the
finish reason; ``stream_options.include_usage`` adds the usage chunk; ``data: [DONE]``):
clients and agent frameworks that only stream work, but tokens are not sent as they are sampled.
Every choice also carries fsdpfn's ``prompt_token_ids`` (the prompt as rendered), ``token_ids``,
``token_logprobs`` (their behav_logp), ``weight_versions`` (per token), ``weight_version``
(the oldest one's label, as /generate's meta_info) and ``temperature`` (the draw's; 0 greedy),
so a trainer records episodes without re-tokenizing (fsdpfn.rollout.agent). A key this server
does not implement (stream, tools, response_format other than text, logit_bias, echo, suffix, ...)
is refused by name: 400 {"error": {"message", "type", "param", "code"}}; so are ``tools`` for a
model whose chat template has no tool-call format.

Log-probs follow fsdpfn's behav_logp convention: log_softmax(logits / temperature) of the
sampled token, before penalties and top-p / top-k truncation; greedy requests (temperature 0)
report log_softmax(logits), temperature 1's.
"""

from __future__ import annotations

import json
import re
import time
import uuid

from fsdpfn.rollout import sglang_api
from fsdpfn.rollout.errors import UpdateError, check_rid
from fsdpfn.rollout.sampling import SamplingParams
from fsdpfn.rollout.tool_calls import parse_tool_calls, tool_format

__all__ = ["models", "completions", "chat_completions", "chat_chunks", "completion_chunks",
           "error_body", "param_of"]

# accepted and without effect here
IGNORED = {"user", "metadata", "store", "stream_options", "service_tier", "model",
           "prompt_cache_key", "safety_identifier"}
# the roles a chat message may have
ROLES = ("system", "developer", "user", "assistant", "tool")
# request key -> SamplingParams key
SAMPLING = {"temperature": "temperature", "top_p": "top_p", "n": "n", "stop": "stop",
            "seed": "seed", "frequency_penalty": "frequency_penalty",
            "presence_penalty": "presence_penalty", "top_k": "top_k", "min_p": "min_p",
            "repetition_penalty": "repetition_penalty", "min_tokens": "min_new_tokens",
            "ignore_eos": "ignore_eos", "stop_token_ids": "stop_token_ids",
            "skip_special_tokens": "skip_special_tokens"}
OFF = {"stream": (None, False), "echo": (None, False), "suffix": (None, ""),
       "logit_bias": (None, {}), "functions": (None, []), "function_call": (None, "none"),
       "response_format": (None, {"type": "text"}), "best_of": (None, 1),
       "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
       "reasoning_effort": (None,), "web_search_options": (None,)}


def _same(value, off) -> bool:
    """``value`` is ``off`` itself: equal and of its type (1 is not true, 0 not false)."""
    return value is off if off is None or isinstance(off, bool) else \
        type(value) is type(off) and value == off


def param_of(message: str | None) -> str | None:
    """The request field an error message names first ("max_tokens: ...", "messages[2].role:
    ..."), OpenAI's ``param``; None when it names none."""
    found = re.match(r"([A-Za-z_]\w*(?:\[\d+\])*(?:\.[A-Za-z_]\w*(?:\[\d+\])*)*):", message or "")
    return found.group(1) if found else None


def error_body(message: str, param: str | None = None, status: int = 400) -> dict:
    """OpenAI's error answer; a server error (status >= 500) names no request field."""
    return {"error": {"message": message, "type": "invalid_request_error"
                      if status < 500 else "server_error",
                      "param": param if status < 500 else None, "code": status}}


def models(engine) -> dict:
    return {"object": "list", "data": [{"id": engine.model_path, "object": "model",
                                        "created": int(time.time()), "owned_by": "fsdpfn",
                                        "root": engine.model_path, "max_model_len":
                                        engine.context}]}


def completions(engine, body: dict) -> dict:
    _refuse(body, {"prompt", "max_tokens", "logprobs", "rid"}, stream_ok=True)
    prompts = _prompts(engine, body.get("prompt"))
    logprobs = body.get("logprobs")
    if logprobs is not None and (not isinstance(logprobs, int) or isinstance(logprobs, bool)
                                 or not 0 <= logprobs <= 20):
        raise UpdateError(f"logprobs: must be null or an int in [0, 20], got {logprobs!r}")
    sp = _params(engine, body, "max_tokens", 16)
    # the prompts of a request run as one batch, as /generate runs them: max_tokens capped at
    # what the longest leaves, a seed's draws different for each prompt
    answer = _generate(engine, prompts, sp, logprobs or 0, "prompt", "max_tokens",
                       body.get("rid"))
    choices = []
    for o in answer["outputs"]:
        prompt = prompts[o["prompt_index"]]
        text = sglang_api.completion_text(engine, o, sp) if engine.tokenizer else ""
        choices.append({"index": len(choices), "text": text, "finish_reason": o["finish_reason"],
                        "logprobs": None if logprobs is None else
                        _completion_logprobs(engine, o, logprobs),
                        **_ours(engine, o, prompt, sp)})
    completion = sum(len(o["output_ids"]) for o in answer["outputs"])
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
            "created": int(time.time()), "model": body.get("model") or engine.model_path,
            "choices": choices, "usage": _usage(sum(len(p) for p in prompts), completion)}


def chat_completions(engine, body: dict) -> dict:
    _refuse(body, {"messages", "max_tokens", "max_completion_tokens", "logprobs", "rid",
                   "top_logprobs", "tools", "tool_choice", "parallel_tool_calls"},
            stream_ok=True)
    for key in ("logprobs", "parallel_tool_calls"):
        if body.get(key) is not None and not isinstance(body[key], bool):
            raise UpdateError(f"{key}: must be null or a bool, got {str(body[key])[:80]!r}")
    tools, fmt = _tools(engine, body)
    prompt = _render(engine, body.get("messages"), tools)
    top = body.get("top_logprobs")
    if top is not None and (not isinstance(top, int) or isinstance(top, bool)
                            or not 0 <= top <= 20):
        raise UpdateError(f"top_logprobs: must be null or an int in [0, 20], got {top!r}")
    if top and not body.get("logprobs"):
        raise UpdateError(f"top_logprobs: needs logprobs true, got logprobs "
                          f"{body.get('logprobs')!r}")
    limit = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
        else "max_tokens"
    sp = _params(engine, body, limit, max(1, engine.context - len(prompt)))
    answer = _generate(engine, [prompt], sp, top or 0, "messages", limit, body.get("rid"))
    choices = []
    for i, o in enumerate(answer["outputs"]):
        message, reason = _message(engine, o, sp, fmt), o["finish_reason"]
        if message.get("tool_calls") and body.get("parallel_tool_calls") is False:
            message["tool_calls"] = message["tool_calls"][:1]  # vLLM's rule: the first call
        if message.get("tool_calls"):
            reason = "tool_calls"
        choices.append({"index": i, "message": message, "finish_reason": reason,
                        "logprobs": {"content": _chat_logprobs(engine, o, top or 0)}
                        if body.get("logprobs") else None, **_ours(engine, o, prompt, sp)})
    completion = sum(len(o["output_ids"]) for o in answer["outputs"])
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
            "created": int(time.time()), "model": body.get("model") or engine.model_path,
            "choices": choices, "usage": _usage(len(prompt), completion)}


# ---------------------------------------------------------------- requests


def _refuse(body: dict, own: set[str], *, stream_ok: bool = False) -> None:
    if not isinstance(body, dict):
        raise UpdateError(f"body: must be a JSON object, got {type(body).__name__}")
    if stream_ok and not isinstance(body.get("stream"), (bool, type(None))):
        raise UpdateError(f"stream: must be null or a bool, got {str(body['stream'])[:80]!r}")
    options = body.get("stream_options")
    if options is not None:
        if not body.get("stream"):
            raise UpdateError(f"stream_options: only with stream true, got stream "
                              f"{body.get('stream')!r}")
        if not isinstance(options, dict) or not all(
                isinstance(v, bool) for v in options.values()):
            raise UpdateError(f"stream_options: must be an object such as "
                              f"{{include_usage: true}}, got {str(options)[:80]!r}")
    for key, off in OFF.items():
        if key == "stream" and stream_ok and (body.get(key) is None
                                              or isinstance(body[key], bool)):
            continue
        if key in body and not any(_same(body[key], o) for o in off):
            raise UpdateError(f"{key}: not supported by this server, got "
                              f"{str(body[key])[:80]!r}")
    check_rid(body.get("rid"), "choice")  # SGLang's: what /abort_request names
    if not isinstance(body.get("model", ""), (str, type(None))):  # echoed in the answer
        raise UpdateError(f"model: must be a string (the model's name; any is served), got "
                          f"{str(body['model'])[:80]!r}")
    unknown = sorted(set(body) - own - set(SAMPLING) - IGNORED - set(OFF))
    if unknown:
        raise UpdateError(f"{unknown[0]}: not a request field this server knows (fields: "
                          f"{sorted(own | set(SAMPLING))}), got {str(body[unknown[0]])[:80]!r}")


def _is_id(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def _prompts(engine, prompt) -> list[list[int]]:
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt
                                   and all(_is_id(t) for t in prompt)):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise UpdateError(f"prompt: must be a string, a token-id list, or a non-empty list of "
                          f"either, got {str(prompt)[:80]!r}")
    out = []
    for p in prompt:
        if isinstance(p, str):
            out.append(sglang_api.encode(engine, p, "prompt"))
        elif isinstance(p, list) and p and all(_is_id(t) for t in p):
            out.append(p)
        else:
            raise UpdateError(f"prompt: each prompt must be a string or a non-empty token-id "
                              f"list, got {str(p)[:80]!r}")
    return out


def _tools(engine, body: dict) -> tuple[list | None, str | None]:
    """The request's tools (None: none) and the model's tool-call format; refusals by name."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise UpdateError(f"tool_choice: only 'auto' and 'none' (a forced or named call needs "
                          f"constrained decoding, which this server does not do), got "
                          f"{str(choice)[:80]!r}")
    if not tools:
        return None, None
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and t.get("type") == "function" and isinstance(
                t.get("function"), dict) and isinstance(t["function"].get("name"), str)
            for t in tools):
        raise UpdateError(f"tools: must be a list of {{type: 'function', function: {{name, "
                          f"description, parameters}}}}, got {str(tools)[:80]!r}")
    fmt = tool_format(getattr(engine.tokenizer, "chat_template", None))
    if fmt is None:
        raise UpdateError(f"tools: the chat template of {engine.model_path!r} has no tool-call "
                          f"format this server reads (hermes <tool_call>, mistral [TOOL_CALLS], "
                          f"llama3 JSON); describe the tools in a message instead")
    return tools, None if choice == "none" else fmt


def _history(messages: list[dict]) -> list[dict]:
    """OpenAI's messages as chat templates read them: a tool call's arguments (a JSON
    string in OpenAI's format) as an object."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            m = {**m, "tool_calls": [_call_object(c) for c in calls]}
        if isinstance(m.get("content"), list):  # text parts, joined by newlines as vLLM does
            m = {**m, "content": "\n".join(p["text"] for p in m["content"])}
        out.append(m)
    return out


def _call_object(call: dict) -> dict:
    fn = dict(call.get("function") or {})
    if isinstance(fn.get("arguments"), str):
        try:
            fn["arguments"] = json.loads(fn["arguments"])
        except ValueError:
            pass
    return {**call, "function": fn}


def _message(engine, o: dict, sp: SamplingParams, fmt: str | None) -> dict:
    text = sglang_api.completion_text(engine, o, sp)
    if fmt is None:
        return {"role": "assistant", "content": text}
    ids = o["output_ids"]
    if o["finish_reason"] == "stop" and isinstance(o.get("matched"), int):
        ids = ids[:-1]  # the end-of-sequence token the answer stopped at is not the call's
    raw = engine.tokenizer.decode(ids, skip_special_tokens=False) \
        if fmt == "mistral" else text
    content, calls = parse_tool_calls(raw, fmt)
    if not calls:
        return {"role": "assistant", "content": text}
    return {"role": "assistant", "content": content, "tool_calls": calls}


def _check_messages(messages) -> None:
    """OpenAI's rules for ``messages``: a known role each, and content a string or a list of
    text parts (an assistant message with tool_calls may have none)."""
    if not isinstance(messages, list) or not messages:
        raise UpdateError(f"messages: must be a non-empty list of {{role, content}}, got "
                          f"{str(messages)[:80]!r}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise UpdateError(f"messages[{i}]: must be an object {{role, content}}, got "
                              f"{str(m)[:80]!r}")
        if m.get("role") not in ROLES:
            raise UpdateError(f"messages[{i}].role: must be one of {list(ROLES)}, got "
                              f"{m.get('role')!r}")
        _check_tool_fields(i, m)
        content = m.get("content")
        if content is None:
            if m["role"] == "assistant" and m.get("tool_calls"):
                continue
            raise UpdateError(f"messages[{i}].content: required for role {m['role']!r} (a "
                              f"string or a list of text parts), got none")
        if not (isinstance(content, str) or isinstance(content, list) and all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                for p in content)):
            raise UpdateError(f"messages[{i}].content: must be a string or a list of "
                              f"{{type: 'text', text}} parts, got {str(content)[:80]!r}")


def _check_tool_fields(i: int, m: dict) -> None:
    """An assistant message's ``tool_calls`` (OpenAI's [{id, type: "function", function:
    {name, arguments}}]) and a tool message's ``tool_call_id``, as OpenAI requires them."""
    calls = m.get("tool_calls")
    if calls is not None:
        if m["role"] != "assistant":
            raise UpdateError(f"messages[{i}].tool_calls: only on an assistant message, got "
                              f"role {m['role']!r}")
        if not isinstance(calls, list):
            raise UpdateError(f"messages[{i}].tool_calls: must be a list of {{id, type: "
                              f"'function', function: {{name, arguments}}}}, got "
                              f"{str(calls)[:80]!r}")
        for k, c in enumerate(calls):
            fn = c.get("function") if isinstance(c, dict) else None
            if not (isinstance(fn, dict) and isinstance(fn.get("name"), str) and fn["name"]
                    and isinstance(fn.get("arguments", ""), (str, dict))
                    and c.get("type", "function") == "function"):
                raise UpdateError(f"messages[{i}].tool_calls[{k}]: must be {{id, type: "
                                  f"'function', function: {{name, arguments (a JSON string)}}}}"
                                  f", got {str(c)[:80]!r}")
    if m["role"] == "tool" and not (isinstance(m.get("tool_call_id"), str)
                                    and m["tool_call_id"]):
        raise UpdateError(f"messages[{i}].tool_call_id: required for role 'tool' (the id of "
                          f"the call it answers), got {m.get('tool_call_id')!r}")


def _render(engine, messages, tools=None) -> list[int]:
    _check_messages(messages)
    tok = engine.tokenizer
    if tok is None or not getattr(tok, "chat_template", None) or not hasattr(tok, "render_chat"):
        raise UpdateError(f"messages: need a chat template, and the model directory "
                          f"{engine.model_path!r} has none; use /v1/completions")
    try:
        text = tok.render_chat(_history(messages), tools=tools) if tools else \
            tok.render_chat(_history(messages))
    except Exception as exc:  # noqa: BLE001 - jinja errors of a user's template
        raise UpdateError(f"messages: the chat template failed: {type(exc).__name__}: "
                          f"{exc}") from None
    return tok.encode(text)


def _openai_name(message: str, limit: str, top_key: str = "logprobs") -> str:
    """An error of SGLang's names (sampling_params.max_new_tokens: ...) in the request's own
    (max_tokens: ...; top_logprobs_num: the request's ``top_key``)."""
    message = message.replace("sampling_params.", "", 1)
    for theirs, ours in ((limit, "max_new_tokens"), ("min_tokens", "min_new_tokens"),
                         ("seed", "seed"), (top_key, "top_logprobs_num")):
        if message.startswith(f"{ours}:"):
            return theirs + message[len(ours):]
    return message


def _generate(engine, prompts: list, sp: SamplingParams, top: int, prompt_key: str,
              limit: str, rid=None) -> dict:
    """engine.generate, its refusals named as the request names things: a prompt
    ``prompt[i]`` (completions) or ``messages`` (chat), the sampling fields OpenAI's way.
    ``rid``: the request's SGLang rid, what /abort_request matches."""
    try:
        return engine.generate(prompts, sp, top_logprobs=top, rid=rid)
    except UpdateError as exc:
        message = str(exc)
        if message.startswith("input_ids["):  # the engine's name for a prompt
            message = (prompt_key + "[" + message[len("input_ids["):] if prompt_key == "prompt"
                       else prompt_key + message[message.index("]") + 1:])
        top_key = "logprobs" if prompt_key == "prompt" else "top_logprobs"
        raise UpdateError(_openai_name(message, limit, top_key), exc.status) from None


def _params(engine, body: dict, limit: str, default: int) -> SamplingParams:
    """The request's SamplingParams; ``limit`` is the key that holds max_new_tokens
    (max_tokens, or chat's max_completion_tokens), named in its errors as sent."""
    spec = {SAMPLING[k]: v for k, v in body.items() if k in SAMPLING and v is not None}
    spec["max_new_tokens"] = default if body.get(limit) is None else body[limit]
    try:
        sp = SamplingParams(**spec)
    except UpdateError as exc:  # name the OpenAI field, not SGLang's
        raise UpdateError(_openai_name(str(exc), limit)) from None
    return sp.with_stops(engine.eos_ids)


# ---------------------------------------------------------------- answers


def _ours(engine, o: dict, prompt: list[int], sp: SamplingParams) -> dict:
    """fsdpfn's fields of a choice: what a trainer needs to train on it without re-tokenizing
    (the prompt as rendered, the sampled ids, their behav_logp, each token's weights version,
    the oldest version's label as /generate gives it, and the temperature the tokens were
    drawn at: 0 for greedy, whose behav_logp are temperature 1's)."""
    versions = o.get("weight_versions") or []
    return {"prompt_token_ids": prompt, "token_ids": o["output_ids"],
            "token_logprobs": o["output_logprobs"], "weight_versions": versions,
            "weight_version": engine.version_label(min(versions)) if versions else None,
            "temperature": float(sp.temperature)}


def _piece(engine, token: int) -> str:
    if engine.tokenizer is None:
        return str(token)
    return engine.tokenizer.decode([token], skip_special_tokens=False)


def _completion_logprobs(engine, o: dict, top: int) -> dict:
    tokens = [_piece(engine, t) for t in o["output_ids"]]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    tops = None
    if top:
        tops = [_top_dict(engine, step[:top]) for step in o.get("output_top_logprobs", [])]
    return {"tokens": tokens, "token_logprobs": o["output_logprobs"], "top_logprobs": tops,
            "text_offset": offsets}


def _top_dict(engine, step: list) -> dict:
    """One position's [[logprob, id], ...] (best first) as OpenAI's {text: logprob}: a token
    whose text is already a key (a better token decodes the same) is keyed "token_id:<id>"."""
    out = {}
    for lp, t in step:
        piece = _piece(engine, t)
        out[f"token_id:{t}" if piece in out else piece] = lp
    return out


def _chat_logprobs(engine, o: dict, top: int) -> list[dict]:
    def entry(t, lp):
        return {"token": _piece(engine, t), "logprob": lp,
                "bytes": engine.tokenizer.token_bytes(t)}  # chat: a tokenizer is there

    steps = o.get("output_top_logprobs") or [[] for _ in o["output_ids"]]
    return [{**entry(t, lp), "top_logprobs": [entry(tt, tlp) for tlp, tt in step[:top]]}
            for t, lp, step in zip(o["output_ids"], o["output_logprobs"], steps)]


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def chat_chunks(completion: dict, *, include_usage: bool = False) -> list[str]:
    """A chat completion as OpenAI's server-sent events: per choice a delta with the role,
    content and tool calls, then one with the finish reason (and fsdpfn's fields); the usage
    chunk when asked; ``[DONE]``."""
    def choice_chunks(c: dict) -> tuple[dict, dict]:
        delta = {"role": "assistant", "content": c["message"].get("content")}
        if c["message"].get("tool_calls"):
            delta["tool_calls"] = [{"index": k, **call}
                                   for k, call in enumerate(c["message"]["tool_calls"])]
        first = {"index": c["index"], "delta": delta, "logprobs": c.get("logprobs"),
                 "finish_reason": None}
        last = {k: v for k, v in c.items() if k not in ("message", "logprobs")}
        return first, {**last, "delta": {}}

    return _events(completion, "chat.completion.chunk", choice_chunks, include_usage)


def completion_chunks(completion: dict, *, include_usage: bool = False) -> list[str]:
    """A completion as OpenAI's server-sent events (object "text_completion"): per choice one
    chunk with its text and log-probs, then one with the finish reason (and fsdpfn's fields);
    the usage chunk when asked; ``[DONE]``."""
    def choice_chunks(c: dict) -> tuple[dict, dict]:
        first = {"index": c["index"], "text": c["text"], "logprobs": c["logprobs"],
                 "finish_reason": None}
        last = {k: v for k, v in c.items() if k not in ("text", "logprobs")}
        return first, {**last, "text": "", "logprobs": None}

    return _events(completion, "text_completion", choice_chunks, include_usage)


def _events(completion: dict, kind: str, choice_chunks, include_usage: bool) -> list[str]:
    head = {"id": completion["id"], "object": kind, "created": completion["created"],
            "model": completion["model"]}
    events = []
    for c in completion["choices"]:
        events += [{**head, "choices": [chunk]} for chunk in choice_chunks(c)]
    if include_usage:
        events.append({**head, "choices": [], "usage": completion["usage"]})
    return [f"data: {json.dumps(e)}\n\n" for e in events] + ["data: [DONE]\n\n"]
