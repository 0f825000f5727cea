"""The HTTP face of a RolloutEngine (FastAPI): SGLang's endpoints and payloads, OpenAI's, plus ours.

| endpoint | payload | answer |
| --- | --- | --- |
| GET /health | | SGLang's: 200, empty (the process serves; /get_model_info says what) |
| GET /health_generate | | SGLang's: 200, empty, once a one-token generation succeeds; 503 if it fails or takes over 20 s (a pause holds it) |
| GET /weight_version | | {weight_version} (fsdpfn's integer version) |
| GET /get_weight_version | | {weight_version} (a string, as SGLang's: the label the last update gave, else the integer version) |
| GET /get_model_info | | SGLang's {model_path, tokenizer_path (null without a tokenizer), is_generation, preferred_sampling_params, weight_version (the label)}, then ours: {version (the int), server_id (new at each start), dtype, device, eos_token_ids, params: {name: {dtype, shape}}, groups, paused, last_error, update_channel (the port of the update channel, or null), model_type, config_fields, config_fingerprint (fsdpfn.wire.model_fingerprint)} |
| POST, PUT /generate | SGLang's GenerateReqInput (fsdpfn/rollout/sglang_api.py) | SGLang's {text, output_ids, meta_info} (a list for several outputs); fsdpfn's {weight_version, outputs} with "return_format": "fsdpfn" |
| GET /v1/models, POST /v1/completions, POST /v1/chat/completions | OpenAI's (fsdpfn/rollout/openai_api.py; chat takes tools, both take stream) | OpenAI's, with log-probs (with stream: server-sent chunks) |
| POST /forward | {input_ids: [[int]], temperature=1, return_logits=false} | {weight_version, token_logprobs, logits?} |
| POST /init_weights_update_group | SGLang's {master_address, master_port, rank_offset, world_size, group_name, backend}, plus timeout_s: the group formed as SGLang forms it | {success, message}; any refusal 400, as SGLang's (also on /destroy_weights_update_group and /update_weights_from_distributed) |
| POST /destroy_weights_update_group | {group_name} | {success, message} |
| POST /update_weights_from_distributed | SGLang's {names, dtypes, shapes, group_name, flush_cache, load_format ("flattened_bucket": one packed broadcast), weight_version (any string)} | {success, message, weight_version (the int), seconds} |
| POST /update_weights_from_disk | {model_path, weight_version (an int or any string), flush_cache, verify_checksums, commit (false: load, check and stage only)} | {success, weight_version, weights_checksum, message}, plus SGLang's num_paused_requests (with commit false: staged, and the checksum the weights will have); a refusal (a missing directory included) 400, as SGLang's |
| POST /update_weights_commit | {weight_version, commit (default true; false: drop)} | the staged update of that version swapped in: {success, weight_version, weights_checksum}; 409 when none of that version is staged |
| POST /update_weights_from_ipc | {buckets: [{names, dtypes, shapes, handle}], weight_version, flush_cache}: each bucket an aligned flat bucket in a device buffer of a process on this GPU (fsdpfn.wire.ipc) | {success, weight_version, weights_checksum, message, seconds} |
| POST /abort_request | SGLang's {rid (a string), abort_all (a bool)} | {success, aborted (the outputs marked)}: the matching requests' outputs end with the tokens they have, finish_reason "abort" (an unknown rid marks none, as SGLang ignores it) |
| GET, POST /flush_cache | | SGLang's text, 200 when no generation is running or waiting (no prefix cache outlives a request: nothing to drop), else 400 with the reason |
| POST /pause_generation, POST /continue_generation | {mode}: SGLang's "abort" (default), "retract" or "in_place", else 400 | SGLang's {message, status: "ok"}, plus success; a pause drains whatever the mode (nothing is aborted) |
| POST /load_lora_adapter | SGLang's {lora_name, lora_path (a peft adapter directory), pinned, lora_id}, plus weight_version | {success, error_message, loaded_adapters, weight_version, weights_checksum}: merged into the served weights (fsdpfn/rollout/lora.py); a refusal is a 400 whose loaded_adapters names what is still served |
| POST /unload_lora_adapter | {lora_name} | same: the base weights served again |

A whole update (update channel, /update_weights_from_disk, /update_weights_from_ipc) may carry
fsdpfn's ``merged_adapters: true``: a LoRA trainer's merged weights, on which no adapter loads.

Beside the HTTP port, ``python -m fsdpfn.rollout`` listens for update channels
(fsdpfn/rollout/receiver.py): fsdpfn's own push, a whole update per message. Every update is the
receiver's (``engine.receiver``).

Failures answer 4xx (the request breaks a rule) or 5xx (the transfer failed) with
{"success": false, "message": ...} and SGLang's "object": "error", "type", "param", "code" (/v1
answers OpenAI's {"error": {message, type, param, code}}); the served weights and version are then unchanged and
generation is not left paused. Blocking handlers are plain ``def`` (run in FastAPI's thread pool),
so /health and generation stay responsive while an update is being received.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Callable

from fsdpfn.rollout import openai_api, sglang_api
from fsdpfn.rollout.engine import RolloutEngine, UpdateError
from fsdpfn.rollout.sampling import SamplingParams

__all__ = ["build_app"]

# SGLang's PauseGenerationReqInput.mode values (its default "abort")
PAUSE_MODES = ("abort", "retract", "in_place")
# /health_generate: SGLang's probe (one token from input_ids [0], greedy) and its time limit
HEALTH_SAMPLING = SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True)
HEALTH_GENERATE_S = 20.0


def _pause_mode(payload: dict) -> str:
    mode = payload.get("mode", "abort")
    if mode not in PAUSE_MODES:
        raise UpdateError(f"mode: must be one of {list(PAUSE_MODES)}, got {mode!r}")
    return mode


def build_app(engine: RolloutEngine):
    import anyio
    import anyio.to_thread
    from fastapi import Body, FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    app = FastAPI(title="fsdpfn rollout server")
    receiver = engine.receiver

    @app.exception_handler(RequestValidationError)
    async def unreadable_body(request, exc):
        """A body that is not JSON: a 400 in the endpoint's own error shape, not FastAPI's 422."""
        message = "body: must be a JSON document, got one that does not parse"
        errors = exc.errors() if hasattr(exc, "errors") else []
        if errors and errors[0].get("msg"):
            message += f" ({errors[0]['msg']})"
        if request.url.path.startswith("/v1/"):
            return JSONResponse(status_code=400, content=openai_api.error_body(message, "body"))
        return sglang_error(400, {"success": False, "message": message})

    def sglang_error(status: int, body: dict) -> JSONResponse:
        """SGLang's error shape, {"object": "error", "message", "code"}, with the update
        endpoints' {"success": false} (what their clients test)."""
        return JSONResponse(status_code=status, content={
            "object": "error", "type": "BadRequestError" if status < 500 else
            "InternalServerError", "param": None, "code": status, **body})

    def answer(fn: Callable[[], Any], refused: int | None = None):
        """``fn()``; an UpdateError answers its status (``refused``: that status instead),
        anything else 500, in sglang_error's shape."""
        try:
            return fn()
        except UpdateError as exc:
            return sglang_error(refused or exc.status, {"success": False, "message": str(exc)})
        except Exception as exc:  # noqa: BLE001 - report, keep serving
            return sglang_error(500, {"success": False,
                                      "message": f"{type(exc).__name__}: {exc}"})

    @app.get("/health")
    async def health():  # SGLang's: 200, an empty body
        return Response(status_code=200)

    @app.get("/weight_version")
    async def weight_version():
        return {"weight_version": engine.version}

    @app.get("/get_weight_version")
    async def get_weight_version():  # SGLang's: a string, the label as given
        return {"weight_version": engine.version_label()}

    @app.get("/get_model_info")
    def model_info():  # SGLang's fields (weight_version the label), then fsdpfn's
        return engine.info()

    # generation requests wait in their own threads (the decode loop batches them), beyond
    # FastAPI's shared pool of 40: many clients neither queue nor block the update handlers
    generation_threads = anyio.CapacityLimiter(4096)

    @app.get("/health_generate")
    async def health_generate():
        """SGLang's: 200 (empty) once a one-token generation from token 0 succeeds, 503 if it
        fails or takes longer than HEALTH_GENERATE_S (a pause holds it until resumed); a probe
        that timed out is aborted, not left queued for after the pause."""
        rid = f"fsdpfn-health-{uuid.uuid4().hex}"
        with anyio.move_on_after(HEALTH_GENERATE_S):
            try:
                await anyio.to_thread.run_sync(
                    lambda: engine.generate([[0]], HEALTH_SAMPLING, rid=rid),
                    limiter=generation_threads, abandon_on_cancel=True)
                return Response(status_code=200)
            except Exception:  # noqa: BLE001 - the answer is the report
                return Response(status_code=503)
        engine.abort(rid)
        return Response(status_code=503)

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(payload: Any = Body(...)):
        # a plain JSONResponse: FastAPI's encoder walks each of the (many) numbers in Python
        return await anyio.to_thread.run_sync(lambda: answer(lambda: JSONResponse(
            sglang_api.generate(engine, payload))), limiter=generation_threads)

    def openai_answer(fn: Callable[[], Any]):
        out = answer(lambda: JSONResponse(fn()))
        if out.status_code >= 400:
            body = json.loads(out.body)
            message = body.get("message")
            return JSONResponse(status_code=out.status_code, content=openai_api.error_body(
                message, openai_api.param_of(message), status=out.status_code))
        return out

    @app.get("/v1/models")
    async def openai_models():
        return openai_api.models(engine)

    def streamed(out, payload, chunks: Callable[..., list[str]]):
        """The answer as server-sent chunks when the request asked for ``stream``."""
        if out.status_code >= 400 or not (isinstance(payload, dict) and payload.get("stream")):
            return out
        usage = bool((payload.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(iter(chunks(json.loads(out.body), include_usage=usage)),
                                 media_type="text/event-stream")

    @app.post("/v1/completions")
    async def openai_completions(payload: Any = Body(...)):
        out = await anyio.to_thread.run_sync(lambda: openai_answer(
            lambda: openai_api.completions(engine, payload)), limiter=generation_threads)
        return streamed(out, payload, openai_api.completion_chunks)

    @app.post("/v1/chat/completions")
    async def openai_chat(payload: Any = Body(...)):
        out = await anyio.to_thread.run_sync(lambda: openai_answer(
            lambda: openai_api.chat_completions(engine, payload)), limiter=generation_threads)
        return streamed(out, payload, openai_api.chat_chunks)

    @app.post("/forward")
    def forward(payload: dict = Body(...)):
        return answer(lambda: engine.forward(
            payload.get("input_ids"), temperature=payload.get("temperature", 1.0),
            return_logits=payload.get("return_logits", False)))

    def group_answer(fn: Callable[[], Any]):
        """SGLang's group endpoints answer every refusal 400 {success: false, message}, as
        SGLang does (its clients test for it); the message says what failed (a busy turn, an
        unknown group, a rendezvous or a transfer that failed)."""
        return answer(fn, refused=400)

    @app.post("/init_weights_update_group")
    def init_group(payload: dict = Body(...)):
        return group_answer(lambda: receiver.init_group(payload))

    @app.post("/destroy_weights_update_group")
    def destroy_group(payload: dict = Body(...)):
        return group_answer(lambda: receiver.destroy_group(payload))

    @app.post("/update_weights_from_distributed")
    def update_distributed(payload: dict = Body(...)):
        return group_answer(lambda: receiver.update_from_distributed(payload))

    @app.post("/update_weights_commit")
    def update_commit(payload: dict = Body(...)):
        return answer(lambda: receiver.commit_staged(payload))

    @app.post("/update_weights_from_ipc")
    def update_ipc(payload: dict = Body(...)):
        return answer(lambda: receiver.update_from_ipc(payload))

    @app.post("/update_weights_from_disk")
    def update_disk(payload: dict = Body(...)):
        out = answer(lambda: {**receiver.update_from_disk(payload), "num_paused_requests": 0})
        if isinstance(out, JSONResponse):  # SGLang's UpdateWeightFromDiskReqOutput fields;
            # SGLang answers a refused update 400 (a missing directory included)
            status = 400 if out.status_code < 500 else out.status_code
            return JSONResponse(status_code=status, content={
                **json.loads(out.body), "code": status, "num_paused_requests": 0})
        return out

    def lora_answer(fn: Callable[[], Any]):
        out = answer(fn)  # SGLang's LoRAUpdateOutput names the failure error_message
        if isinstance(out, JSONResponse):
            body = json.loads(out.body)
            slot = receiver.adapter  # what is still served after the refusal
            body["error_message"] = body.get("message")
            body["loaded_adapters"] = {} if slot is None else {slot.name: slot.path}
            return JSONResponse(status_code=out.status_code, content=body)
        return out

    @app.post("/load_lora_adapter")
    def load_lora(payload: dict = Body(...)):
        return lora_answer(lambda: receiver.load_lora_adapter(payload))

    @app.post("/unload_lora_adapter")
    def unload_lora(payload: dict = Body(...)):
        return lora_answer(lambda: receiver.unload_lora_adapter(payload))

    @app.post("/abort_request")
    def abort_request(payload: dict = Body(default={})):
        def run():
            rid, every = payload.get("rid"), payload.get("abort_all", False)
            if rid is not None and not isinstance(rid, str):
                raise UpdateError(f"rid: must be a string, got {str(rid)[:80]!r}")
            if not isinstance(every, bool):
                raise UpdateError(f"abort_all: must be true or false, got {every!r}")
            marked = engine.abort(rid, every)
            return {"success": True, "aborted": marked,
                    "message": f"{marked} output(s) aborted"}
        return answer(run)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    def flush_cache():
        # SGLang's answer text; it refuses while requests run or wait, and so does this
        text = ("Cache flushed.\nPlease check backend logs for more details. (When there are "
                "running or waiting requests, the operation will not be performed.)\n")
        if engine.busy():
            return Response(content=text + "Reason: generation requests are running or "
                            "waiting\n", status_code=400, media_type="text/plain")
        return Response(content=text, status_code=200, media_type="text/plain")

    # SGLang's answers; a pause drains (requests in flight finish, new ones wait), whatever
    # the mode (one of SGLang's PAUSE_MODES): nothing is aborted
    @app.post("/pause_generation")
    def pause(payload: dict = Body(default={})):
        return answer(lambda: (_pause_mode(payload), engine.pause(), {
            "message": "Generation paused successfully.", "status": "ok", "success": True})[2])

    @app.post("/continue_generation")
    def resume(payload: dict = Body(default={})):
        return answer(lambda: (engine.resume(), {
            "message": "Generation continued successfully.", "status": "ok",
            "success": True})[1])

    return app
