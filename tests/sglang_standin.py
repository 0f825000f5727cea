"""A stand-in for a stock SGLang server, written from SGLang's own definitions (not fsdpfn's server).

Request bodies are validated against schemas copied field by field from SGLang's io_struct.py
(sgl-project/sglang python/sglang/srt/managers/io_struct.py @ 001067ff; every struct also has
BaseReq's rid and http_worker_ipc) with pydantic's lax rules as SGLang applies them: a missing
required field or a wrong type is HTTP 400 {"object": "error", "message", "code": 400}; unknown
keys are ignored; "123" passes as an int, 3 does not pass as a str.

The update group is joined as SGLang's init_custom_process_group joins it
(python/sglang/srt/utils/common.py): torch's rendezvous("tcp://addr:port", rank, world_size),
PrefixStore(group_name, store), torch's own _new_process_group_helper. Updates with
load_format="flattened_bucket" receive ONE broadcast of the tensors packed back to back (SGLang's
FlattenedTensorBucket: torch.cat of the flattened tensors) and load them at once, as
model_runner._update_bucketed_weights_from_distributed does. /generate answers
meta_info.output_token_logprobs as [logprob, token_id, null] rows from a real HF model, greedy
(temperature 0: log_softmax of the raw logits, as SGLang reports).

Every request, the pause state at its arrival and the tensors received are recorded for the test.
"""

from __future__ import annotations

import datetime
import json
import threading
import typing
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Dict, List, Literal, Optional, Union

import torch

REQUIRED = object()
_BASE = {"rid": (Optional[str], None), "http_worker_ipc": (Optional[str], None)}

# field: (type, default or REQUIRED), as in io_struct.py
SCHEMAS: dict[str, dict[str, tuple]] = {
    "/init_weights_update_group": {  # InitWeightsUpdateGroupReqInput
        **_BASE, "master_address": (str, REQUIRED), "master_port": (int, REQUIRED),
        "rank_offset": (int, REQUIRED), "world_size": (int, REQUIRED),
        "group_name": (str, "weight_update_group"), "backend": (str, "nccl")},
    "/update_weights_from_distributed": {  # UpdateWeightsFromDistributedReqInput
        **_BASE, "names": (List[str], REQUIRED), "dtypes": (List[str], REQUIRED),
        "shapes": (List[List[int]], REQUIRED), "group_name": (str, "weight_update_group"),
        "flush_cache": (bool, True), "abort_all_requests": (bool, False),
        "weight_version": (Optional[str], None), "load_format": (Optional[str], None),
        "torch_empty_cache": (bool, False)},
    "/update_weights_from_disk": {  # UpdateWeightFromDiskReqInput
        **_BASE, "model_path": (str, REQUIRED), "load_format": (Optional[str], None),
        "abort_all_requests": (bool, False), "weight_version": (Optional[str], None),
        "is_async": (bool, False), "torch_empty_cache": (bool, False),
        "keep_pause": (bool, False), "recapture_cuda_graph": (bool, False),
        "token_step": (int, 0), "flush_cache": (bool, True),
        "manifest": (Optional[Dict[str, Any]], None)},
    "/destroy_weights_update_group": {  # DestroyWeightsUpdateGroupReqInput
        **_BASE, "group_name": (str, "weight_update_group")},
    "/pause_generation": {  # PauseGenerationReqInput
        **_BASE, "mode": (Literal["abort", "retract", "in_place"], "abort")},
    "/continue_generation": {  # ContinueGenerationReqInput
        **_BASE, "torch_empty_cache": (bool, True)},
    "/generate": {  # GenerateReqInput (the fields a probe may use)
        "rid": (Optional[Union[List[str], str]], None),
        "text": (Optional[Union[List[str], str]], None),
        "input_ids": (Optional[Union[List[List[int]], List[int]]], None),
        "sampling_params": (Optional[Union[List[Dict[str, Any]], Dict[str, Any]]], None),
        "return_logprob": (Optional[Union[List[bool], bool]], None),
        "logprob_start_len": (Optional[Union[List[int], int]], None),
        "top_logprobs_num": (Optional[Union[List[int], int]], None),
        "stream": (bool, False), "lora_path": (Optional[Union[List[Optional[str]], str]], None)},
}
# SamplingParams' keyword arguments (sampling_params.py), the keys a sampling_params dict may hold
SAMPLING_KEYS = {"max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p",
                 "top_k", "min_p", "frequency_penalty", "presence_penalty",
                 "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex", "ebnf",
                 "structural_tag", "ignore_eos", "skip_special_tokens",
                 "spaces_between_special_tokens", "no_stop_trim", "custom_params",
                 "stream_interval", "logit_bias", "sampling_seed"}


def _valid(value, tp) -> bool:
    """pydantic's lax validation of a JSON value against ``tp``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return True
    if origin is Union:
        return any(_valid(value, a) for a in args)
    if tp is type(None):
        return value is None
    if origin is Literal:
        return value in args
    if origin in (list, List):
        return isinstance(value, list) and all(_valid(v, args[0]) for v in value)
    if origin in (dict, Dict):
        return isinstance(value, dict) and all(isinstance(k, str) for k in value)
    if tp is str:
        return isinstance(value, str)
    if tp is bool:
        return isinstance(value, bool) or value in (0, 1) or (
            isinstance(value, str) and value.lower() in ("true", "false", "0", "1", "yes",
                                                         "no", "on", "off"))
    if tp is int:
        if isinstance(value, bool):
            return True  # lax: a bool passes as an int
        if isinstance(value, int):
            return True
        if isinstance(value, float):
            return value.is_integer()
        return isinstance(value, str) and value.strip().lstrip("-").isdigit()
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) or (
            isinstance(value, str) and _is_number(value))
    raise AssertionError(f"no rule for {tp}")


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def validate(path: str, body) -> list[str]:
    """The problems SGLang's validation would report for ``body`` at ``path`` (empty: valid)."""
    if not isinstance(body, dict):
        return [f"{path}: body must be a JSON object, got {type(body).__name__}"]
    problems = []
    for name, (tp, default) in SCHEMAS[path].items():
        if name not in body:
            if default is REQUIRED:
                problems.append(f"{path}: field {name!r} is required")
        elif not _valid(body[name], tp):
            problems.append(f"{path}: field {name!r} must be {tp}, got {body[name]!r}")
    if path == "/generate":
        params = body.get("sampling_params") or {}
        for p in params if isinstance(params, list) else [params]:
            unknown = set(p) - SAMPLING_KEYS
            if unknown:  # SamplingParams(**params) raises TypeError on them
                problems.append(f"/generate: sampling_params has unknown keys {sorted(unknown)}")
    return problems


def init_custom_process_group(*, backend, init_method, timeout, world_size, rank, group_name):
    """As SGLang's (utils/common.py): rendezvous, PrefixStore(group_name), torch's helper."""
    from torch.distributed.distributed_c10d import (Backend, PrefixStore,
                                                    _new_process_group_helper, _world,
                                                    rendezvous)

    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store,
                                      group_name=group_name, backend_options=None,
                                      timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


class StandIn:
    """The server's state: an HF model, its update groups, what it received, what it was asked."""

    def __init__(self, model_dir: str | Path, *, device: str = "cpu",
                 dtype: torch.dtype = torch.float32, record: bool = True):
        from transformers import AutoModelForCausalLM

        self.model_dir = str(model_dir)
        self.device = torch.device(device)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=dtype).to(
            self.device).eval()
        self.record = record  # keep a copy of every received tensor (for the tests)
        self.weight_version = "default"
        self.groups: dict[str, Any] = {}
        self.paused = False
        self.log: list[dict] = []  # {path, body, paused} per request, in arrival order
        self.invalid: list[str] = []
        self.received: dict[str, torch.Tensor] = {}
        self.corrupt = False  # load the received tensors permuted (a server that mangles them)
        self.lock = threading.Lock()

    # -------------------------------------------------------------- endpoints

    def handle(self, path: str, body) -> tuple[int, Any]:
        with self.lock:
            self.log.append({"path": path, "body": body, "paused": self.paused})
        if path in SCHEMAS:
            problems = validate(path, body)
            if problems:
                self.invalid.extend(problems)
                return 400, {"object": "error", "message": "; ".join(problems), "code": 400}
            body = {name: body.get(name, default)
                    for name, (_, default) in SCHEMAS[path].items()}
        return getattr(self, path.strip("/"))(body)

    def health(self, body):
        return 200, None

    def get_model_info(self, body):
        return 200, {"model_path": self.model_dir, "tokenizer_path": self.model_dir,
                     "is_generation": True, "preferred_sampling_params": None,
                     "weight_version": self.weight_version}

    def get_server_info(self, body):
        return 200, {"tp_size": 1, "dp_size": 1, "model_path": self.model_dir}

    def get_weight_version(self, body):
        return 200, {"weight_version": self.weight_version}

    def pause_generation(self, body):
        self.paused = True
        return 200, {"message": "Generation paused successfully.", "status": "ok"}

    def continue_generation(self, body):
        self.paused = False
        return 200, {"message": "Generation continued successfully.", "status": "ok"}

    def init_weights_update_group(self, body):
        try:
            pg = init_custom_process_group(
                backend=body["backend"],
                init_method=f"tcp://{body['master_address']}:{int(body['master_port'])}",
                timeout=datetime.timedelta(seconds=60),
                world_size=int(body["world_size"]), rank=int(body["rank_offset"]),
                group_name=body["group_name"])
        except Exception as exc:  # noqa: BLE001 - reported as SGLang does
            return 400, {"success": False, "message": f"Failed to init group: {exc}"}
        self.groups[body["group_name"]] = pg
        return 200, {"success": True, "message": "Succeeded to initialize custom process group."}

    def destroy_weights_update_group(self, body):
        import torch.distributed as dist

        pg = self.groups.pop(body["group_name"], None)
        if pg is None:
            return 400, {"success": False, "message": "group not found"}
        dist.destroy_process_group(pg)
        return 200, {"success": True, "message": "Succeeded to destroy custom process group."}

    def update_weights_from_distributed(self, body):
        import torch.distributed as dist

        if body["group_name"] not in self.groups:
            return 400, {"success": False, "message": f"Group {body['group_name']} not in "
                                                       f"{list(self.groups)}"}
        if body["load_format"] != "flattened_bucket":
            return 400, {"success": False, "message": "the stand-in takes flattened buckets"}
        named = [(n, torch.empty(s, dtype=getattr(torch, d), device=self.device))
                 for n, d, s in zip(body["names"], body["dtypes"], body["shapes"])]
        flat = torch.cat([t.flatten() for _, t in named])
        dist.broadcast(flat, src=0, group=self.groups[body["group_name"]])
        tensors, start = [], 0
        for name, t in named:
            tensors.append((name, flat[start:start + t.numel()].reshape(t.shape).clone()))
            start += t.numel()
        self._load(tensors)
        if body["weight_version"] is not None:
            self.weight_version = body["weight_version"]
        return 200, {"success": True, "message": "Succeeded to update parameter online."}

    def update_weights_from_disk(self, body):
        from safetensors.torch import load_file

        files = sorted(Path(body["model_path"]).glob("*.safetensors"))
        if not files:
            return 400, {"success": False, "message": "no safetensors", "num_paused_requests": 0}
        tensors = [item for f in files for item in load_file(str(f)).items()]
        self._load(tensors)
        if body["weight_version"] is not None:
            self.weight_version = body["weight_version"]
        return 200, {"success": True, "message": "Succeeded to update model weights.",
                     "num_paused_requests": 0}

    def _load(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """model.load_weights: each named tensor copied into the served parameter at once."""
        params = dict(self.model.named_parameters())
        with self.lock, torch.no_grad():
            for name, t in tensors:
                if self.record:
                    self.received[name] = t.clone()
                if self.corrupt:
                    t = t.flatten().flip(0).reshape(t.shape)
                params[name].copy_(t)

    def generate(self, body):
        params = body["sampling_params"] or {}
        ids = list(body["input_ids"])
        out, logps = [], []
        with torch.no_grad():
            for _ in range(int(params.get("max_new_tokens", 128))):
                logits = self.model(torch.tensor([ids + out], device=self.device)).logits[0, -1]
                logits = logits.float()
                logp = torch.log_softmax(logits, -1)
                token = int(logp.argmax())
                out.append(token)
                logps.append(float(logp[token]))
        meta = {"id": "0", "finish_reason": {"type": "length", "length": len(out)},
                "prompt_tokens": len(ids), "completion_tokens": len(out),
                "weight_version": self.weight_version, "cached_tokens": 0}
        if body["return_logprob"]:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(logps, out)]
        return 200, {"output_ids": out, "meta_info": meta}


class _Handler(BaseHTTPRequestHandler):
    standin: StandIn

    def log_message(self, *args):  # quiet
        pass

    def _answer(self, code: int, payload) -> None:
        data = b"" if payload is None else json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _route(self, body) -> None:
        path = self.path.split("?")[0]
        if not hasattr(StandIn, path.strip("/")) or path.strip("/").startswith("_"):
            self._answer(404, {"detail": "Not Found"})
            return
        self._answer(*self.standin.handle(path, body))

    def do_GET(self):
        self._route({})

    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b"{}"
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            self._answer(400, {"object": "error", "message": "invalid JSON", "code": 400})
            return
        self._route(body)


def serve(model_dir: str | Path, *, port: int = 0,
          **kwargs) -> tuple[StandIn, ThreadingHTTPServer, str]:
    """Start a stand-in on 127.0.0.1 (a free port by default) in a daemon thread: (state, server,
    url). kwargs go to StandIn (device, dtype, record)."""
    standin = StandIn(model_dir, **kwargs)
    handler = type("Handler", (_Handler,), {"standin": standin})
    server = ThreadingHTTPServer(("127.0.0.1", port), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return standin, server, f"http://127.0.0.1:{server.server_address[1]}"


if __name__ == "__main__":  # a stand-in in its own process (benchmarks/push.py --sglang)
    import argparse
    import time

    parser = argparse.ArgumentParser(description="an SGLang-protocol stand-in server")
    parser.add_argument("model_dir")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--record", action="store_true", help="keep every received tensor")
    args = parser.parse_args()
    if args.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(args.device).index or 0)
    serve(args.model_dir, port=args.port, device=args.device, dtype=getattr(torch, args.dtype),
          record=args.record)
    print(f"serving on http://127.0.0.1:{args.port}", flush=True)
    while True:
        time.sleep(3600)
