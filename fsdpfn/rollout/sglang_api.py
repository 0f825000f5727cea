"""SGLang's /generate on a RolloutEngine: its request (GenerateReqInput, io_struct.py) and its
answer (tokenizer_manager.py), as SGLang clients (AReaL, verl, slime) send and parse them.

Request: ``input_ids`` ([int] or [[int]]) or ``text`` (str or [str]; needs the model's
tokenizer), ``sampling_params`` (a dict, or one per prompt; keys of fsdpfn.rollout.sampling),
``return_logprob``, ``top_logprobs_num``, ``return_text_in_logprobs``, ``rid``. SGLang's defaults
apply: max_new_tokens 128, and the model's end-of-sequence ids stop a row unless ignore_eos.
Fields SGLang has that this server does not serve (stream, image_data, input logprobs from
logprob_start_len >= 0, custom_logit_processor, ...) are refused by name when set; other unknown
top-level keys are ignored, as SGLang ignores them.

Answer, per output: {"text" (when the model has a tokenizer), "output_ids", "meta_info": {"id",
"finish_reason": {"type": "stop", "matched"} | {"type": "length", "length"} | {"type":
"abort", "message"} (the output ended by /abort_request), "prompt_tokens",
"completion_tokens", "cached_tokens", "weight_version" (a string, as SGLang's: the label an
update gave those weights, else the integer version),
"weight_versions" (fsdpfn: the version of each token, ints), "e2e_latency", "num_retractions"
and "reasoning_tokens" (0: nothing is retracted, no reasoning parser runs), and with
return_logprob "input_token_logprobs" ([]), "output_token_logprobs" [[logprob, id, text|null]],
with top_logprobs_num "output_top_logprobs"}}: one object for one prompt with n == 1, else a list
(prompt-major: the n samples of prompt i are [i*n, (i+1)*n)).

fsdpfn's own answer, {weight_version (int), outputs: [{prompt_index, output_ids,
output_logprobs, finish_reason, weight_versions}]} (fsdpfn.rollout.client reads it), is given
for ``"return_format": "fsdpfn"``, and packed (the per-token lists as bytes: 5.6 against 16 MB
at 512 x 1,024 tokens, fsdpfn/rollout/packing.py) for ``"fsdpfn_packed"``; SGLang ignores that
key, and its stops are then exactly stop_token_ids (no implicit end-of-sequence id).
"""

from __future__ import annotations

import time
import uuid

from fsdpfn.rollout import packing
from fsdpfn.rollout.errors import UpdateError, check_flags, check_rid
from fsdpfn.rollout.sampling import SamplingParams, prompt_seed

__all__ = ["generate", "encode_prompts"]

# top-level GenerateReqInput fields refused when set (value other than these "off" values)
REFUSED = {"stream": (None, False), "image_data": (None, [], ""), "video_data": (None, [], ""),
           "audio_data": (None, [], ""), "input_embeds": (None, []),
           "custom_logit_processor": (None, ""), "token_ids_logprob": (None, []),
           "session_params": (None, {}), "return_hidden_states": (None, False),
           "logprob_start_len": (None, -1)}


def generate(engine, payload: dict):
    """One /generate request (see the module doc); the answer as SGLang shapes it, or fsdpfn's
    with ``return_format`` "fsdpfn"."""
    start = time.perf_counter()
    if not isinstance(payload, dict):
        raise UpdateError(f"/generate: the body must be a JSON object, got "
                          f"{type(payload).__name__}")
    _refuse(engine, payload)
    own = payload.get("return_format") in ("fsdpfn", "fsdpfn_packed")
    prompts, single = encode_prompts(engine, payload.get("input_ids"), payload.get("text"))
    top_n = _top_n(payload)
    # return_logprob and top_logprobs_num: one for all prompts, or one per prompt
    wants = [bool(v) for v in _per_prompt(payload, "return_logprob", len(prompts))]
    tops = [min(int(v or 0), top_n) if w else 0 for v, w in
            zip(_per_prompt(payload, "top_logprobs_num", len(prompts)), wants)]
    specs = payload.get("sampling_params") or {}
    if isinstance(specs, list):
        if len(specs) != len(prompts):
            raise UpdateError(f"sampling_params: a list must hold one dict per prompt "
                              f"({len(prompts)}), got {len(specs)}")
        runs = [([p], _at_prompt(_params(engine, s, own), i))
                for i, (p, s) in enumerate(zip(prompts, specs))]
    else:
        runs = [(prompts, _params(engine, specs, own))]
    packed = payload.get("return_format") == "fsdpfn_packed"  # bytes straight from the tensors
    answers, offset, rids = [], 0, payload.get("rid")
    for p, sp in runs:  # each run's outputs' rids: what /abort_request matches
        size = len(p) * sp.n
        rid = rids[offset:offset + size] if isinstance(rids, list) else rids
        answers.append((engine.generate(p, sp, top_logprobs=top_n, lists=not packed, rid=rid),
                        sp))
        offset += size
    if own:
        answer = _own(answers)
        return packing.pack(answer) if packed else answer
    items = _sglang(engine, payload, answers, prompts, wants, tops, time.perf_counter() - start)
    n = runs[0][1].n
    return items[0] if single and n == 1 and len(items) == 1 else items


def _refuse(engine, payload: dict) -> None:
    for key, off in REFUSED.items():
        if key in payload and payload[key] not in off:
            raise UpdateError(f"{key}: not supported by this server (must be "
                              f"{off[-1]!r} or absent), got {str(payload[key])[:80]!r}")
    check_flags(payload, ("return_text_in_logprobs",))
    check_rid(payload.get("rid"), "output")
    lora = payload.get("lora_path")
    if not isinstance(lora, (str, type(None))) and not (
            isinstance(lora, list) and all(isinstance(w, str) for w in lora)):
        raise UpdateError(f"lora_path: must be an adapter's name or path, or a list of them, "
                          f"got {str(lora)[:80]!r}")
    if lora not in (None, "", []):
        slot = engine.receiver.adapter
        names = {getattr(slot, "name", None), getattr(slot, "path", None)} - {None}
        wanted = lora if isinstance(lora, list) else [lora]
        if not all(w in names for w in wanted):
            raise UpdateError(f"lora_path: must name the adapter merged into the served "
                              f"weights ({sorted(names) or 'none loaded'}), got {lora!r}")


def encode_prompts(engine, input_ids, text) -> tuple[list[list[int]], bool]:
    """(token-id prompts, whether the request held a single prompt)."""
    if input_ids is not None and text is not None:
        raise UpdateError("input_ids, text: give one of them, got both")
    if input_ids is not None:
        if not isinstance(input_ids, list):
            raise UpdateError(f"input_ids: must be a list of token ids or a list of such lists, "
                              f"got {str(input_ids)[:80]!r}")
        single = bool(input_ids) and all(isinstance(t, int) for t in input_ids)
        return ([input_ids] if single else input_ids), single
    if text is None:
        raise UpdateError("input_ids: required (or text), got neither")
    single = isinstance(text, str)
    texts = [text] if single else text
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise UpdateError(f"text: must be a string or a non-empty list of strings, got "
                          f"{str(text)[:80]!r}")
    return [encode(engine, t, "text") for t in texts], single


def encode(engine, text: str, field: str) -> list[int]:
    if engine.tokenizer is None:
        raise UpdateError(f"{field}: text needs a tokenizer, and the model directory "
                          f"{engine.model_path!r} has none; send token ids (input_ids)")
    try:
        ids = engine.tokenizer.encode(text)
    except ValueError as exc:
        raise UpdateError(f"{field}: {exc}") from None
    if not ids:
        raise UpdateError(f"{field}: must encode to at least one token, got {text!r}")
    return ids


def _top_n(payload: dict) -> int:
    top = payload.get("top_logprobs_num") or 0
    if isinstance(top, list):
        top = max(top) if top else 0
    if not isinstance(top, int) or top < 0:
        raise UpdateError(f"top_logprobs_num: must be an int >= 0, got {top!r}")
    return top if _flag(payload.get("return_logprob")) else 0


def _flag(value) -> bool:
    """return_logprob: a bool, or one per prompt (any true has the engine compute them; each
    prompt's answer carries them where its own is true)."""
    if not (value is None or isinstance(value, bool)
            or (isinstance(value, list) and all(isinstance(v, bool) for v in value))):
        raise UpdateError(f"return_logprob: must be a bool (or a list of them, one per "
                          f"prompt), got {str(value)[:80]!r}")
    return any(value) if isinstance(value, list) else bool(value)


def _params(engine, spec, own: bool) -> SamplingParams:
    if not isinstance(spec, dict):
        raise UpdateError(f"sampling_params: must be a dict (or one per prompt), got "
                          f"{str(spec)[:80]!r}")
    spec = {"max_new_tokens": 128, **{k: v for k, v in spec.items() if v is not None}}
    sp = SamplingParams(**spec)
    return sp if own else sp.with_stops(engine.eos_ids)


def _at_prompt(sp: SamplingParams, index: int) -> SamplingParams:
    """``sp`` of prompt ``index`` run as a request of its own: a seed becomes the prompt's own,
    prompt_seed(seed, index), so it draws what it draws in one request of every prompt."""
    if sp.seed is not None and index:
        sp.seed = prompt_seed(sp.seed, index)
    return sp


def _own(answers) -> dict:
    outputs, offset = [], 0
    for answer, _ in answers:
        for o in answer["outputs"]:
            outputs.append({**o, "prompt_index": o["prompt_index"] + offset})
        offset += max(o["prompt_index"] for o in answer["outputs"]) + 1
    return {"weight_version": min(a["weight_version"] for a, _ in answers), "outputs": outputs}


def _per_prompt(payload: dict, key: str, n: int) -> list:
    """``payload[key]`` for each of the ``n`` prompts: a list holds one per prompt."""
    value = payload.get(key)
    if not isinstance(value, list):
        return [value] * n
    if len(value) != n:
        raise UpdateError(f"{key}: a list must hold one value per prompt ({n}), got "
                          f"{len(value)}")
    return value


def _sglang(engine, payload, answers, prompts, wants: list[bool], tops: list[int],
            seconds: float) -> list[dict]:
    """SGLang's answer objects; ``wants`` / ``tops``: each prompt's return_logprob and
    top_logprobs_num."""
    rids = payload.get("rid")
    with_text = bool(payload.get("return_text_in_logprobs"))  # checked by _refuse
    items, offset = [], 0
    for answer, sp in answers:
        for o in answer["outputs"]:
            index = o["prompt_index"] + offset
            rid = rids[len(items)] if isinstance(rids, list) and len(rids) > len(items) else (
                rids if isinstance(rids, str) and len(prompts) == 1 and sp.n == 1 else None)
            items.append(output(engine, o, sp, len(prompts[index]), rid=rid,
                                logprobs=wants[index], text_in_logprobs=with_text,
                                top_n=tops[index], seconds=seconds))
        offset += max(o["prompt_index"] for o in answer["outputs"]) + 1
    return items


def output(engine, o: dict, sp: SamplingParams, prompt_tokens: int, *, rid=None,
           logprobs: bool = False, text_in_logprobs: bool = False, top_n: int = 0,
           seconds: float = 0.0) -> dict:
    """One engine output as one SGLang /generate answer object."""
    ids = o["output_ids"]
    if o["finish_reason"] == "stop":
        reason = {"type": "stop", "matched": o.get("matched")}
    elif o["finish_reason"] == "abort":  # SGLang's FINISH_ABORT
        reason = {"type": "abort", "message": "Abort request: /abort_request"}
    else:
        reason = {"type": "length", "length": len(ids)}
    versions = o.get("weight_versions") or []
    meta = {"id": rid or uuid.uuid4().hex, "finish_reason": reason,
            "prompt_tokens": prompt_tokens, "completion_tokens": len(ids), "cached_tokens": 0,
            "weight_version": engine.version_label(min(versions) if versions else None),
            "weight_versions": versions, "e2e_latency": seconds,
            "num_retractions": 0, "reasoning_tokens": 0}  # nothing retracted, no reasoning parser
    piece = (lambda t: engine.tokenizer.decode([t], skip_special_tokens=False)) \
        if text_in_logprobs and engine.tokenizer is not None else (lambda t: None)
    if logprobs:
        meta["input_token_logprobs"] = []
        meta["output_token_logprobs"] = [[lp, t, piece(t)] for lp, t in
                                         zip(o["output_logprobs"], ids)]
    if top_n:
        meta["input_top_logprobs"] = []
        meta["output_top_logprobs"] = [[[lp, t, piece(t)] for lp, t in step]
                                       for step in o.get("output_top_logprobs", [])]
    item = {"output_ids": ids, "meta_info": meta}
    if engine.tokenizer is not None:
        item = {"text": completion_text(engine, o, sp), **item}
    return item


def completion_text(engine, o: dict, sp: SamplingParams) -> str:
    """The output's text: special tokens skipped per ``skip_special_tokens``; unless
    ``no_stop_trim``, a matched stop string and what follows it cut, and a matched stop token
    id left out of the text (SGLang's trim_matched_stop; output_ids keep it)."""
    ids = o["output_ids"]
    matched = o.get("matched")
    if isinstance(matched, int) and not isinstance(matched, bool) and not sp.no_stop_trim \
            and len(ids) and int(ids[-1]) == matched:
        ids = ids[:-1]
    text = engine.tokenizer.decode(ids, skip_special_tokens=sp.skip_special_tokens)
    if isinstance(matched, str) and not sp.no_stop_trim and matched in text:
        text = text[:text.index(matched)]
    return text
