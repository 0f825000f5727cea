"""The HTTP face of a RolloutEngine (FastAPI): SGLang's endpoint names and payloads, plus ours.

| endpoint | payload | answer |
| --- | --- | --- |
| GET /health | | {status, weight_version, server_id, groups} |
| GET /weight_version, GET /get_weight_version | | {weight_version} |
| GET /get_model_info | | {model_path, dtype, device, weight_version, params: {name: {dtype, shape}}, groups, paused, last_error, multi_bucket, update_channel (the port of the update channel, or null)} |
| POST /generate | {input_ids: [[int]] or [int], sampling_params: {temperature, top_p, top_k, max_new_tokens, stop_token_ids, n, seed}} | {weight_version (the oldest of the tokens'), outputs: [{prompt_index, output_ids, output_logprobs, finish_reason, weight_versions (per token)}]} |
| POST /forward | {input_ids: [[int]], temperature=1, return_logits=false} | {weight_version, token_logprobs, logits?} |
| POST /init_weights_update_group | {master_address, master_port, rank_offset, world_size, group_name, backend, timeout_s} | {success, message} |
| POST /destroy_weights_update_group | {group_name} | {success} |
| POST /update_weights_from_distributed | {names, dtypes, shapes, group_name, flush_cache, load_format, weight_version, update_id, bucket_index, commit}, or the whole update at once: {buckets: [{names, dtypes, shapes}], group_name, weight_version, update_id, pause_generation, load_format} | {success, weight_version, weights_checksum (on commit), message, seconds} |
| POST /update_weights_from_disk | {model_path, weight_version, flush_cache, verify_checksums} | same |
| POST /update_weights_from_ipc | {buckets: [{names, dtypes, shapes, handle}], weight_version, flush_cache}: tensors in a device buffer of a process on this GPU (fsdpfn.weights.ipc) | same |
| POST /pause_generation, POST /continue_generation | {} | {success} |
| POST /load_lora_adapter | SGLang's {lora_name, lora_path (a peft adapter directory), pinned, lora_id}, plus weight_version | {success, error_message, loaded_adapters, weight_version, weights_checksum}: merged into the served weights (fsdpfn/rollout/lora.py) |
| POST /unload_lora_adapter | {lora_name} | same: the base weights served again |

Beside the HTTP port, ``python -m fsdpfn.rollout`` listens for update channels
(fsdpfn/rollout/channel.py): the fast path of a weight push, the same whole update without HTTP.

Failures answer 4xx (the request breaks a rule) or 5xx (the transfer failed) with
{"success": false, "message": ...}; the served weights and version are then unchanged and
generation is not left paused. Blocking handlers are plain ``def`` (run in FastAPI's thread pool),
so /health and generation stay responsive while an update is being received.
"""

from __future__ import annotations

from typing import Any, Callable

from fsdpfn.rollout.engine import RolloutEngine, SamplingParams, UpdateError

__all__ = ["build_app"]


def build_app(engine: RolloutEngine):
    import anyio
    import anyio.to_thread
    from fastapi import Body, FastAPI
    from fastapi.responses import JSONResponse

    app = FastAPI(title="fsdpfn rollout server")

    def answer(fn: Callable[[], Any]):
        try:
            return fn()
        except UpdateError as exc:
            return JSONResponse(status_code=exc.status,
                                content={"success": False, "message": str(exc)})
        except Exception as exc:  # noqa: BLE001 - report, keep serving
            return JSONResponse(status_code=500, content={
                "success": False, "message": f"{type(exc).__name__}: {exc}"})

    @app.get("/health")
    async def health():
        return {"status": "ok", "weight_version": engine.version, "server_id": engine.server_id,
                "groups": engine.group_names}

    @app.get("/weight_version")
    @app.get("/get_weight_version")
    async def weight_version():
        return {"weight_version": engine.version}

    @app.get("/get_model_info")
    def model_info():
        return engine.info()

    # generation requests wait in their own threads (the decode loop batches them), beyond
    # FastAPI's shared pool of 40: many clients neither queue nor block the update handlers
    generation_threads = anyio.CapacityLimiter(4096)

    @app.post("/generate")
    async def generate(payload: dict = Body(...)):
        # a plain JSONResponse: FastAPI's encoder walks each of the (many) numbers in Python
        return await anyio.to_thread.run_sync(lambda: answer(lambda: JSONResponse(
            engine.generate(payload.get("input_ids"),
                            SamplingParams(**(payload.get("sampling_params") or {}))))),
            limiter=generation_threads)

    @app.post("/forward")
    def forward(payload: dict = Body(...)):
        return answer(lambda: engine.forward(
            payload.get("input_ids"), temperature=float(payload.get("temperature", 1.0)),
            return_logits=bool(payload.get("return_logits", False))))

    @app.post("/init_weights_update_group")
    def init_group(payload: dict = Body(...)):
        return answer(lambda: engine.init_group(payload))

    @app.post("/destroy_weights_update_group")
    def destroy_group(payload: dict = Body(...)):
        return answer(lambda: engine.destroy_group(str(payload.get("group_name"))))

    @app.post("/update_weights_from_distributed")
    def update_distributed(payload: dict = Body(...)):
        return answer(lambda: engine.update_from_distributed(payload))

    @app.post("/update_weights_from_ipc")
    def update_ipc(payload: dict = Body(...)):
        return answer(lambda: engine.update_from_ipc(payload))

    @app.post("/update_weights_from_disk")
    def update_disk(payload: dict = Body(...)):
        return answer(lambda: engine.update_from_disk(payload))

    def lora_answer(fn: Callable[[], Any]):
        out = answer(fn)  # SGLang's LoRAUpdateOutput names the failure error_message
        if isinstance(out, JSONResponse):
            import json

            body = json.loads(out.body)
            body["error_message"] = body.get("message")
            return JSONResponse(status_code=out.status_code, content=body)
        return out

    @app.post("/load_lora_adapter")
    def load_lora(payload: dict = Body(...)):
        return lora_answer(lambda: engine.load_lora_adapter(payload))

    @app.post("/unload_lora_adapter")
    def unload_lora(payload: dict = Body(...)):
        return lora_answer(lambda: engine.unload_lora_adapter(payload))

    @app.post("/pause_generation")
    def pause(payload: dict = Body(default={})):
        return answer(lambda: (engine.pause(), {"success": True})[1])

    @app.post("/continue_generation")
    def resume(payload: dict = Body(default={})):
        return answer(lambda: (engine.resume(), {"success": True})[1])

    return app
