"""RolloutEngine: the model a rollout server serves, its generation, and its atomic weight updates.

Everything here is plain Python (no HTTP), so it can be tested and embedded directly.

Concurrency. ``_model_lock`` is held by every generation or forward while it runs, and by the swap
of an update; so a request sees one weights version from start to end (its response names it).
``pause()`` makes new generation requests wait and returns once none is running;
``resume()`` lets them go. A pause expires by itself after ``max_pause_s`` (a trainer that died
between pause and continue cannot stall the server), and a failed update resumes generation.

Updates are staged: received tensors go into a staging dict (a second copy of the weights), are
validated against the served model (name known, shape, dtype, not given twice; at commit: every
parameter present, all finite), and only then swapped in under the model lock: each served
parameter is pointed at its received tensor (no copy; the old storage is freed). Any failure
discards the staging; the served weights and version are untouched. Per-bucket checks (finite
values, per-tensor checksums) are queued on the device as each bucket arrives and read once, at
commit. A whole update (one request, or the update channel) takes the model lock once its
receives are posted and re-points the parameters while the bytes arrive (nothing reads them
meanwhile); a failed check points them back before the lock is released.

Buckets of one update may be posted before the previous one is done (a trainer overlaps the
HTTP round trip with the transfer): a request waits, up to its group's timeout, for its turn
(bucket_index == the next expected bucket of its update_id).

behav_logp convention: the log-prob of each sampled token is log_softmax(logits / temperature)
at that token: temperature applied, top-p / top-k truncation not (it is what the trainer's
``forward_logp(..., temperature=T)`` computes for the same weights and tokens). Greedy decoding
(temperature 0) reports log_softmax(logits).
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Sequence

import torch

from fsdpfn.rollout import lora as rollout_lora
from fsdpfn.rollout.errors import UpdateError
from fsdpfn.rollout.sampling import Penalties, SamplingParams, find_stop
from fsdpfn.rollout.text import eos_ids, load_tokenizer
from fsdpfn.weights.protocol import (MANIFEST, broadcast, bucket_layout, combine_checksums,
                                     combine_on_device,
                                     dtype_from_name, dtype_name, flat_checksums, make_group,
                                     padded_size, sha256_of, tensor_checksums, wait_work,
                                     word_sums, zero_padding)

__all__ = ["RolloutEngine", "UpdateError", "SamplingParams"]


class _Staging:
    def __init__(self, update_id: str | None):
        self.update_id = update_id
        self.tensors: dict[str, torch.Tensor] = {}
        self.next_bucket = 0
        self.order_error: str | None = None
        # queued on the device per bucket, read at commit: (names, int64 checksums), bool flags
        self.sums: list[tuple[list[str], torch.Tensor]] = []
        self.finite: list[torch.Tensor] = []


class _BucketLayout:
    """One flat bucket of a whole update: names, dtypes, shapes, and where each tensor lies."""

    def __init__(self, names: list[str], dtypes: list[str], shapes: list[list[int]]):
        self.names, self.dtypes, self.shapes = names, dtypes, shapes
        try:
            self.torch_dtypes = [dtype_from_name(d) for d in dtypes]
        except ValueError as exc:
            error = UpdateError(f"dtypes: {exc}")
            error.unsized = True  # the bytes on the wire cannot be sized
            raise error from None
        self.offsets, self.total = bucket_layout(dtypes, shapes)
        self.sizes = [math.prod(s) * d.itemsize for d, s in zip(self.torch_dtypes, shapes)]
        self.strides = self.elements = None
        if len(set(self.torch_dtypes)) == 1:
            size = self.torch_dtypes[0].itemsize
            self.elements = [o // size for o in self.offsets]
            self.strides = [torch.empty(s, device="meta").stride() for s in shapes]


class _Layout:
    """A whole update's buckets, parsed and checked against the served model once (the update
    channel keeps it per connection and layout id, so a repeated push re-parses nothing).
    ``problems``: why it cannot be committed (unknown names, shapes, dtypes, a tensor twice, a
    served parameter missing), empty when it can."""

    def __init__(self, engine: "RolloutEngine", buckets_json):
        try:
            parsed = [([str(n) for n in b["names"]], [str(d) for d in b["dtypes"]],
                       [[int(x) for x in s] for s in b["shapes"]]) for b in buckets_json]
        except (KeyError, TypeError, ValueError) as exc:
            raise UpdateError(f"update_weights_from_distributed: buckets must be a list of "
                              f"{{names, dtypes, shapes}}; got {str(buckets_json)[:120]} "
                              f"({type(exc).__name__}: {exc})") from None
        if not parsed or any(not (len(n) == len(d) == len(s)) for n, d, s in parsed):
            raise UpdateError("buckets: must be a non-empty list, with names, dtypes, shapes of "
                              "equal lengths in every bucket")
        self.buckets = [_BucketLayout(*b) for b in parsed]
        names = [n for b in self.buckets for n in b.names]
        self.problems = engine._validate(  # noqa: SLF001
            names, [d for b in self.buckets for d in b.torch_dtypes],
            [s for b in self.buckets for s in b.shapes], _Staging(None))
        sent = {engine.aliases.get(n, n) for n in names}
        missing = [n for n in engine.params if n not in sent]
        if missing:
            self.problems.append(f"every parameter of the served model must be sent, got none "
                                 f"for {len(missing)} (e.g. {missing[:3]})")
        self.canonical = [[engine.aliases.get(n, n) for n in b.names] for b in self.buckets]
        self.nbytes = sum(b.total for b in self.buckets)


class RolloutEngine:
    def __init__(self, model_path: str, *, dtype: str = "auto", device: str = "cpu",
                 weight_version: int = 0, max_pause_s: float = 600.0, decode: str = "auto",
                 decode_rows: int | None = None, decode_max_len: int = 2048,
                 cuda_graphs: bool = True):
        from transformers import AutoModelForCausalLM

        self.model_path = str(model_path)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        kwargs: dict[str, Any] = {"attn_implementation": "sdpa"}
        kwargs["dtype"] = "auto" if dtype == "auto" else dtype_from_name(dtype)
        model = AutoModelForCausalLM.from_pretrained(self.model_path, **kwargs)
        self.model = model.to(self.device).eval().requires_grad_(False)
        self.params: dict[str, torch.nn.Parameter] = dict(self.model.named_parameters())
        # state-dict names that alias a served parameter (a tied lm_head.weight)
        by_id = {id(p): n for n, p in self.params.items()}
        self.aliases = {n: by_id[id(t)] for n, t in self.model.state_dict(keep_vars=True).items()
                        if n not in self.params and id(t) in by_id}
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.pad_token_id = int(getattr(self.model.config, "pad_token_id", None) or 0)
        self.version = int(weight_version)
        self.max_pause_s = float(max_pause_s)
        self._model_lock = threading.Lock()
        self._gen_cond = threading.Condition()
        self._paused = False
        self._pause_timer: threading.Timer | None = None
        self._active = 0
        self._groups: dict[str, tuple] = {}  # name -> (store, pg, backend, timeout_s)
        self._retired: list = []  # groups left mid-operation: kept alive, never destroyed here
        self._staging: _Staging | None = None
        self._turn = threading.Condition()  # orders the buckets of one update (see module doc)
        self._busy = False
        self._failed: set[str] = set()  # update ids that failed: their later buckets are refused
        self.last_error: str | None = None
        self.lora_slot = None  # the adapter merged in, if any (fsdpfn.rollout.lora)
        self.server_id = uuid.uuid4().hex  # changes when the server restarts
        self.channel_port: int | None = None  # the update channel's port, when one listens
        self._channels: dict[str, list] = {}  # group name -> update channel sockets bound to it
        self._channels_lock = threading.Lock()
        self._stream = None  # the CUDA stream that checks received buckets (lazily)
        # a whole update holds the model lock while its bytes arrive for at most this long; a
        # slower sender lets generation run meanwhile (the swap then waits for the last byte)
        self.hold_s = 2.0
        self._decoder = self._build_decoder(decode, decode_rows, decode_max_len, cuda_graphs)
        self.tokenizer = _load_text(self.model_path)  # None: text fields are refused
        self.eos_ids = eos_ids(self.model_path, self.tokenizer)

    def _build_decoder(self, mode: str, rows: int | None, max_len: int, cuda_graphs: bool):
        """The decode loop (fsdpfn/rollout/decode.py) for ``mode`` "loop", or "auto" on CUDA;
        None: HF ``generate`` (``mode`` "hf", or "auto" on CPU or for a model the loop does
        not serve, logged)."""
        from fsdpfn.rollout import decode

        if mode not in ("auto", "hf", "loop"):
            raise UpdateError(f"decode: must be 'auto', 'hf' or 'loop', got {mode!r}")
        if mode == "hf" or (mode == "auto" and self.device.type != "cuda"):
            return None
        reason = decode.unsupported_reason(self.model)
        if reason is not None:
            if mode == "loop":
                raise UpdateError(f"decode: 'loop' cannot serve this model: {reason}")
            decode.log.warning("decode loop off (%s): generation uses HF generate", reason)
            return None
        max_len = min(int(max_len), int(getattr(self.model.config, "max_position_embeddings",
                                                max_len)))
        per_slot = decode._Model.kv_bytes_per_slot(self.model, max_len)  # noqa: SLF001
        if rows is None:  # half of the free memory for the KV cache, at most 1024 rows
            free = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" \
                else 64 * per_slot
            rows = max(8, min(1024, int(0.5 * free // per_slot) // 8 * 8))
        decoder = decode.Decoder(self.model, lock=self._model_lock, version=lambda: self.version,
                                 slots=int(rows), max_len=max_len, cuda_graphs=cuda_graphs)
        decode.log.warning("decode loop on: %d rows x %d positions (%.1f GB of KV cache), CUDA "
                           "graphs %s", rows, max_len, rows * per_slot / 1e9,
                           "on" if decoder.use_graphs else "off")
        return decoder

    # ------------------------------------------------------------ info

    @property
    def group_names(self) -> list[str]:
        return sorted(self._groups)

    @property
    def dtype(self) -> torch.dtype:
        return next(iter(self.params.values())).dtype

    def info(self) -> dict:
        return {"model_path": self.model_path, "server_id": self.server_id,
                "dtype": dtype_name(self.dtype),
                "device": str(self.device), "weight_version": self.version,
                "ipc": self.device.type == "cuda",
                "is_generation": True, "vocab_size": self.vocab_size, "multi_bucket": True,
                "update_channel": self.channel_port,
                "paused": self._paused,
                "decode": "hf" if self._decoder is None else (
                    f"loop ({self._decoder.slots} rows x {self._decoder.max_len}, CUDA graphs "
                    f"{'on' if self._decoder.use_graphs else 'off'})"),
                "decode_stats": None if self._decoder is None else {
                    "steps": self._decoder.steps, "seconds": self._decoder.step_seconds,
                    "graphs": len(self._decoder.graphs)},
                "tokenizer_path": self.model_path if self.tokenizer is not None else None,
                "preferred_sampling_params": None, "eos_token_ids": self.eos_ids,
                "groups": self.group_names, "last_error": self.last_error,
                "params": {n: {"dtype": dtype_name(p.dtype), "shape": list(p.shape)}
                           for n, p in self.params.items()}}

    def weights_checksum(self) -> int:
        names = list(self.params)
        sums = tensor_checksums([self.params[n] for n in names])
        return combine_checksums(dict(zip(names, sums)))

    # ------------------------------------------------------------ pause / resume

    def pause(self) -> None:
        """New generation requests wait; returns when none is running."""
        with self._gen_cond:
            self._paused = True
            if self._pause_timer is not None:
                self._pause_timer.cancel()
            self._pause_timer = threading.Timer(self.max_pause_s, self.resume)
            self._pause_timer.daemon = True
            self._pause_timer.start()
            while self._active:
                self._gen_cond.wait()

    def resume(self) -> None:
        with self._gen_cond:
            self._paused = False
            if self._pause_timer is not None:
                self._pause_timer.cancel()
                self._pause_timer = None
            self._gen_cond.notify_all()

    def _enter_generation(self) -> None:
        with self._gen_cond:
            while self._paused:
                self._gen_cond.wait()
            self._active += 1

    def _leave_generation(self) -> None:
        with self._gen_cond:
            self._active -= 1
            self._gen_cond.notify_all()

    # ------------------------------------------------------------ generation and forward

    def _check_ids(self, rows: Sequence[Sequence[int]], what: str) -> list[list[int]]:
        if not isinstance(rows, list) or not rows:
            raise UpdateError(f"{what}: must be a non-empty list of token-id lists, got "
                              f"{type(rows).__name__}")
        if all(isinstance(t, int) for t in rows):
            rows = [rows]
        out = []
        for i, row in enumerate(rows):
            if not isinstance(row, list) or not row or \
                    not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in row):
                raise UpdateError(f"{what}[{i}]: must be a non-empty list of ints in "
                                  f"[0, {self.vocab_size}), got {str(row)[:80]}")
            out.append(row)
        return out

    def generate(self, input_ids: list, sampling: SamplingParams, *,
                 top_logprobs: int = 0) -> dict:
        """Returns {"weight_version", "outputs": [{"prompt_index", "output_ids",
        "output_logprobs", "finish_reason" ("stop" | "length"), "matched" (the stop token id or
        stop string, when "stop"), "weight_versions", "output_top_logprobs" (with
        ``top_logprobs`` > 0: per token, [[logprob, token_id], ...] best first)}]}, n outputs
        per prompt, prompt-major. ``weight_versions``: the weights version that produced each
        token; ``weight_version``: the oldest of them (the only one unless weights were swapped
        while the request ran in the decode loop, which swaps between steps)."""
        prompts = self._check_ids(input_ids, "input_ids")
        if sampling.stop and self.tokenizer is None:
            raise UpdateError("sampling_params.stop: stop strings need a tokenizer, and the "
                              f"model directory {self.model_path!r} has none")
        if self._decoder is not None:
            self._check_decode(prompts, sampling, top_logprobs)
        self._enter_generation()
        try:
            if self._decoder is not None:
                outputs = self._decoder.generate(prompts, sampling)
                version = min(min(o["weight_versions"] or [self.version]) for o in outputs)
            else:
                with self._model_lock:
                    version = self.version
                    outputs = self._generate(prompts, sampling, top_logprobs)
                for o in outputs:
                    o["weight_versions"] = [version] * len(o["output_ids"])
        finally:
            self._leave_generation()
        for o in outputs:
            self._finish(o, sampling)
        return {"weight_version": version, "outputs": outputs}

    def _finish(self, o: dict, sp: SamplingParams) -> None:
        """Cut an output at its first stop string (stop strings are matched on the finished
        tokens, on both generation paths); name what stopped it."""
        if o["finish_reason"] == "stop":
            o["matched"] = o["output_ids"][-1]
        hit = find_stop(o["output_ids"], self.tokenizer.decode, sp.stop,
                        sp.min_new_tokens) if sp.stop else None
        if hit is not None and (hit[0] < len(o["output_ids"]) or o["finish_reason"] != "stop"):
            end, o["matched"], o["finish_reason"] = hit[0], hit[1], "stop"
            for key in ("output_ids", "output_logprobs", "weight_versions",
                        "output_top_logprobs"):
                if key in o:
                    o[key] = o[key][:end]

    def _check_decode(self, prompts: list[list[int]], sp: SamplingParams,
                      top_logprobs: int = 0) -> None:
        from fsdpfn.rollout.decode import MAX_STOPS

        limit = self._decoder.max_len
        longest = max(len(p) for p in prompts)
        if longest + sp.max_new_tokens > limit:
            raise UpdateError(f"sampling_params.max_new_tokens: prompt length plus "
                              f"max_new_tokens must be <= the server's decode max length "
                              f"{limit} (--decode-max-len), got {longest} + "
                              f"{sp.max_new_tokens}")
        if len(sp.stop_token_ids) > MAX_STOPS:
            raise UpdateError(f"sampling_params.stop_token_ids: must hold at most {MAX_STOPS} "
                              f"ids, got {len(sp.stop_token_ids)}")
        off = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
               "min_new_tokens": 0, "min_p": 0.0}
        for key, default in off.items():
            if getattr(sp, key) != default:
                raise UpdateError(f"sampling_params.{key}: not supported by the decode loop "
                                  f"(must be {default}; start the server with --decode hf), got "
                                  f"{getattr(sp, key)!r}")
        if top_logprobs:
            raise UpdateError(f"top_logprobs_num: not supported by the decode loop (must be 0; "
                              f"start the server with --decode hf), got {top_logprobs}")

    def _generate(self, prompts: list[list[int]], sp: SamplingParams,
                  top_logprobs: int = 0) -> list[dict]:
        rows = [p for p in prompts for _ in range(sp.n)]  # n samples per prompt, prompt-major
        width = max(len(p) for p in rows)
        ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, p in enumerate(rows):  # left padding: every prompt ends at the same column
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        config, processors = _generation_config(sp, width, self.pad_token_id)
        recorder = _LogprobRecorder(sp.temperature if sp.temperature > 0 else 1.0, top_logprobs)
        handle = self.model.register_forward_hook(recorder, with_kwargs=True)
        try:
            if sp.seed is not None:
                torch.manual_seed(int(sp.seed))
            with torch.no_grad():
                out = self.model.generate(input_ids=ids.to(self.device),
                                          attention_mask=mask.to(self.device),
                                          generation_config=config,
                                          logits_processor=processors)
        finally:
            handle.remove()
        new = out.sequences[:, width:].cpu()  # (B*n, L)
        logps = recorder.finish(new)  # (B*n, L)
        tops = recorder.top(new.shape[1])
        stops = set(sp.stop_token_ids)
        results = []
        for row in range(new.shape[0]):
            tokens = new[row].tolist()
            end, reason = len(tokens), "length"
            for j, t in enumerate(tokens):
                if t in stops:
                    end, reason = j + 1, "stop"
                    break
            results.append({"prompt_index": row // sp.n, "output_ids": tokens[:end],
                            "output_logprobs": logps[row, :end].tolist(),
                            "finish_reason": reason})
            if tops is not None:
                values, index = tops
                results[-1]["output_top_logprobs"] = [
                    [[v, i] for v, i in zip(vs, ix)]
                    for vs, ix in zip(values[row, :end].tolist(), index[row, :end].tolist())]
        return results

    def forward(self, input_ids: list, *, temperature: float = 1.0,
                return_logits: bool = False) -> dict:
        """Teacher-forced scoring: token_logprobs[b][t] = log softmax(logits/T) of ids[t] given
        ids[:t] (0 at t=0); logits [b][t][V] when asked (ragged rows, no padding)."""
        rows = self._check_ids(input_ids, "input_ids")
        if not temperature > 0:
            raise UpdateError(f"temperature: must be > 0, got {temperature!r}")
        width = max(len(r) for r in rows)
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):  # right padding: causal attention never sees it
            ids[i, :len(r)] = torch.tensor(r)
            mask[i, :len(r)] = 1
        with self._model_lock, torch.no_grad():
            version = self.version
            logits = self.model(input_ids=ids.to(self.device),
                                attention_mask=mask.to(self.device)).logits.float().cpu()
        logp = torch.log_softmax(logits / temperature, dim=-1)
        token = torch.zeros_like(ids, dtype=torch.float32)
        token[:, 1:] = logp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
        out = {"weight_version": version,
               "token_logprobs": [token[i, :len(r)].tolist() for i, r in enumerate(rows)]}
        if return_logits:
            out["logits"] = [logits[i, :len(r)].tolist() for i, r in enumerate(rows)]
        return out

    # ------------------------------------------------------------ weight updates

    def init_group(self, payload: dict) -> dict:
        """/init_weights_update_group: {master_address, master_port, rank_offset, world_size,
        group_name, backend, timeout_s (ours, default 300)}; blocks until every member joined."""
        try:
            name = str(payload["group_name"])
            backend = str(payload.get("backend") or "gloo")
            args = dict(master_address=str(payload["master_address"]),
                        master_port=int(payload["master_port"]),
                        rank=int(payload["rank_offset"]), world_size=int(payload["world_size"]),
                        group_name=name, backend=backend,
                        timeout_s=float(payload.get("timeout_s") or 300.0))
        except (KeyError, TypeError, ValueError) as exc:
            raise UpdateError(f"init_weights_update_group: payload must hold master_address, "
                              f"master_port, rank_offset, world_size, group_name; got "
                              f"{sorted(payload)} ({type(exc).__name__}: {exc})") from None
        if backend == "nccl" and self.device.type != "cuda":
            raise UpdateError(f"backend: 'nccl' needs a server on cuda, this one serves on "
                              f"{self.device}")
        with self._exclusive(args["timeout_s"]):
            self._retire(name)
            try:
                group = make_group(device=self.device, **args)
            except Exception as exc:  # noqa: BLE001 - rendezvous failures come in many types
                raise UpdateError(f"init_weights_update_group {name!r}: joining "
                                  f"{args['master_address']}:{args['master_port']} as rank "
                                  f"{args['rank']} of {args['world_size']} failed: "
                                  f"{type(exc).__name__}: {exc}", 500) from None
            self._groups[name] = (*group, backend, args["timeout_s"])
        return {"success": True, "message": f"joined group {name!r}"}

    def destroy_group(self, name: str) -> dict:
        with self._exclusive(60.0):
            self._retire(name)
        return {"success": True}

    def _retire(self, name: str) -> None:
        group = self._groups.pop(name, None)
        if group is not None:
            self._retired.append(group)
        with self._channels_lock:
            sockets = self._channels.pop(name, [])
        for sock in sockets:  # the trainer learns the group is gone from the closed connection
            _shut(sock)

    def attach_channel(self, group_name: str, sock) -> None:
        """Bind an update channel connection to a group: it is closed when the group is
        dropped."""
        with self._channels_lock:
            if group_name not in self._groups:
                raise UpdateError(f"group_name: no weights-update group {group_name!r} on this "
                                  f"server (groups: {self.group_names})", 404)
            self._channels.setdefault(group_name, []).append(sock)

    def detach_channel(self, sock) -> None:
        with self._channels_lock:
            for sockets in self._channels.values():
                if sock in sockets:
                    sockets.remove(sock)

    def update_from_distributed(self, payload: dict, *, layout: "_Layout | None" = None,
                                ack=None) -> dict:
        """/update_weights_from_distributed: {names, dtypes, shapes, group_name, flush_cache,
        load_format ("flattened_bucket": one uint8 broadcast; else one broadcast per tensor),
        weight_version, update_id, bucket_index, commit}. Without update_id the call is a
        self-contained (possibly partial) update, as in SGLang. With ``buckets`` (a list of
        {names, dtypes, shapes}; advertised as multi_bucket in /get_model_info) the whole update
        is one request (see _update_buckets; the update channel passes its parsed ``layout``
        and an ``ack()`` to call once the update is accepted, before any byte is sent)."""
        update_id = payload.get("update_id")
        try:
            index = int(payload.get("bucket_index") or 0)
        except (TypeError, ValueError):
            index = 0
        group = self._groups.get(str(payload.get("group_name")))
        wait_s = float(group[3]) if group is not None else 0.0
        clock = time.perf_counter()
        self._wait_turn(update_id, index, wait_s)
        waited = time.perf_counter() - clock
        try:
            if update_id is not None and update_id in self._failed:
                # an earlier bucket failed: the sender has dropped the group, nothing will come
                self._retire(str(payload.get("group_name")))
                raise UpdateError(f"bucket_index {index}: update {update_id!r} already failed "
                                  f"({self.last_error}); group dropped, previous weights kept",
                                  409)
            answer = (self._update_buckets(payload, layout, ack) if layout is not None
                      else self._update_from_distributed(payload))
            answer["seconds"] = {"wait_turn": waited, **answer.get("seconds", {}),
                                 "total": time.perf_counter() - clock}
            return answer
        except UpdateError as exc:
            if update_id is not None:
                if len(self._failed) > 1000:
                    self._failed.clear()
                self._failed.add(update_id)
            self._fail(exc)
            raise
        finally:
            with self._turn:
                self._busy = False
                self._turn.notify_all()

    @contextlib.contextmanager
    def _exclusive(self, wait_s: float):
        """No other update, group change or bucket runs meanwhile (409 after ``wait_s``)."""
        self._wait_turn(None, 0, wait_s)
        try:
            yield
        finally:
            with self._turn:
                self._busy = False
                self._turn.notify_all()

    def _wait_turn(self, update_id, index: int, wait_s: float) -> None:
        """Block until no update runs and, for bucket ``index`` > 0 of ``update_id``, until the
        buckets before it are done (or the update failed, or was replaced); 409 after
        ``wait_s``."""
        deadline = time.monotonic() + wait_s
        with self._turn:
            while True:
                st = self._staging
                ready = (update_id is None or index == 0 or update_id in self._failed
                         or st is None or st.update_id != update_id or st.next_bucket >= index)
                if not self._busy and ready:
                    self._busy = True
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise UpdateError("update_weights_from_distributed: another update is in "
                                      "progress", 409)
                self._turn.wait(remaining)

    def _fail(self, exc: UpdateError) -> None:
        self._staging = None
        self.last_error = str(exc)
        self.resume()  # a failed update never leaves generation paused

    def _update_from_distributed(self, payload: dict) -> dict:
        if payload.get("buckets") is not None:
            try:
                layout = _Layout(self, payload["buckets"])
            except UpdateError as exc:
                if getattr(exc, "unsized", False):  # the group is out of step: drop it
                    self._retire(str(payload.get("group_name")))
                    raise UpdateError(f"{exc}; group {payload.get('group_name')!r} dropped, "
                                      f"re-initialise it") from None
                raise
            return self._update_buckets(payload, layout, None)
        try:
            names = [str(n) for n in payload["names"]]
            dtypes = [str(d) for d in payload["dtypes"]]
            shapes = [[int(d) for d in s] for s in payload["shapes"]]
            group_name = str(payload["group_name"])
        except (KeyError, TypeError, ValueError) as exc:
            raise UpdateError(f"update_weights_from_distributed: payload must hold names, "
                              f"dtypes, shapes, group_name; got {sorted(payload)} "
                              f"({type(exc).__name__}: {exc})") from None
        if not (len(names) == len(dtypes) == len(shapes)):
            raise UpdateError(f"names, dtypes, shapes: must have equal lengths, got "
                              f"{len(names)}, {len(dtypes)}, {len(shapes)}")
        self._require_group(group_name)
        flat = payload.get("load_format") == "flattened_bucket"
        torch_dtypes = self._torch_dtypes(dtypes, group_name)
        update_id = payload.get("update_id")
        staging = self._staging_for(update_id, int(payload.get("bucket_index") or 0))
        problems = self._validate(names, torch_dtypes, shapes, staging)
        clock = time.perf_counter()
        received, sums, finite = self._receive(group_name, flat, dtypes, torch_dtypes, shapes)
        seconds = {"receive": time.perf_counter() - clock}
        if problems:
            raise UpdateError("update rejected, previous weights kept: " + "; ".join(problems))
        staging.tensors.update(zip(names, received))
        staging.sums.append(([self.aliases.get(n, n) for n in names], sums))
        staging.finite.append(finite)
        staging.next_bucket += 1
        commit = bool(payload.get("commit", update_id is None))
        if not commit:
            return {"success": True, "weight_version": self.version, "staged":
                    len(staging.tensors), "message": f"staged {len(names)} tensors",
                    "seconds": seconds}
        version = _version_of(payload, self.version + 1)
        clock = time.perf_counter()
        answer = self._commit(staging, version,
                              partial=update_id is None)
        seconds["commit"] = time.perf_counter() - clock
        return {**answer, "seconds": seconds}

    def _require_group(self, group_name: str) -> None:
        if group_name not in self._groups:
            raise UpdateError(f"group_name: no weights-update group {group_name!r} on this "
                              f"server (groups: {self.group_names}); call "
                              f"/init_weights_update_group first", 404)

    def _torch_dtypes(self, dtypes: list[str], group_name: str) -> list[torch.dtype]:
        try:
            return [dtype_from_name(d) for d in dtypes]
        except ValueError as exc:
            # the bytes on the wire cannot be sized: the group is out of step, drop it
            self._retire(group_name)
            raise UpdateError(f"dtypes: {exc}; group {group_name!r} dropped, "
                              f"re-initialise it") from None

    def _staging_for(self, update_id, bucket_index: int) -> _Staging:
        current = self._staging
        if update_id is None:
            return _Staging(None)
        if current is None or current.update_id != update_id:
            current = self._staging = _Staging(update_id)  # a new update drops an abandoned one
        if bucket_index != current.next_bucket:
            self._staging = None
            # still receive the bytes (keeps the group in step), then reject
            bad = _Staging(update_id)
            bad.order_error = (f"bucket_index: must be {current.next_bucket} (the next bucket "
                               f"of update {update_id!r}), got {bucket_index}")
            return bad
        return current

    def _validate(self, names, dtypes, shapes, staging: _Staging) -> list[str]:
        problems = [staging.order_error] if staging.order_error else []
        seen = set(staging.tensors)
        unknown = []
        for name, dtype, shape in zip(names, dtypes, shapes):
            canonical = self.aliases.get(name, name)
            param = self.params.get(canonical)
            if param is None:
                unknown.append(name)
            elif list(param.shape) != list(shape):
                problems.append(f"tensor {name!r}: shape must equal the served "
                                f"{list(param.shape)}, got {list(shape)}")
            elif dtype != param.dtype:
                problems.append(f"tensor {name!r}: dtype must equal the served "
                                f"{dtype_name(param.dtype)}, got {dtype_name(dtype)}")
            if canonical in seen:
                problems.append(f"tensor {name!r}: must be sent once per update, got it again")
            seen.add(canonical)
        if unknown:
            problems.insert(0, f"tensor {unknown[0]!r}: name must be a parameter of the served "
                               f"model, got {len(unknown)} unknown name(s) {unknown[:4]}"
                               f"{' ...' if len(unknown) > 4 else ''} (served names look like "
                               f"{next(iter(self.params))!r})")
        return problems[:8] + ([f"... {len(problems) - 8} more"] if len(problems) > 8 else [])

    def _receive(self, group_name, flat, dtypes, torch_dtypes, shapes):
        """(tensors, their int64 checksums, a bool "all finite"), the checks queued on the
        device, not read."""
        store, pg, backend, timeout_s = self._groups[group_name]
        device = self.device if backend == "nccl" else torch.device("cpu")
        try:
            if flat:
                bucket = _BucketLayout([""] * len(dtypes), list(dtypes), shapes)
                buf, work = self._post_flat(pg, device, bucket.total)
                wait_work(work, backend, timeout_s)
                return self._unpack_flat(buf.to(self.device), bucket)
            out = []
            for d, s in zip(torch_dtypes, shapes):
                t = torch.empty(s, dtype=d, device=device)
                wait_work(broadcast(pg, t), backend, timeout_s)
                out.append(t)
        except Exception as exc:  # noqa: BLE001 - a dead or stalled sender: gloo/nccl errors
            self._retire(group_name)
            raise UpdateError(f"receiving over group {group_name!r} failed: "
                              f"{type(exc).__name__}: {exc}; group dropped, previous weights "
                              f"kept", 500) from None
        out = [t.to(self.device) for t in out]
        sums = word_sums(out) if out else \
            torch.zeros(0, dtype=torch.int64, device=self.device)
        finite = torch.stack([torch.isfinite(t).all() for t in out]).all() if out else \
            torch.ones((), dtype=torch.bool, device=self.device)
        return out, sums, finite

    @staticmethod
    def _post_flat(pg, device, total: int):
        """Allocate a padded flat bucket of ``total`` bytes and post its receive; (buffer,
        work)."""
        buf = torch.empty(padded_size(total), dtype=torch.uint8, device=device)
        return buf, broadcast(pg, buf[:total])

    @staticmethod
    def _unpack_flat(buf, b: "_BucketLayout"):
        """A received flat bucket -> (tensor views, int64 checksums, bool "all finite"); the
        checks are queued on the device (on the current stream), not read."""
        buf[b.total:].zero_()
        zero_padding(buf, b.offsets, b.sizes)
        if b.strides is not None:  # one dtype: one typed view, then a strided view per tensor
            typed = buf.view(b.torch_dtypes[0])
            out = [typed.as_strided(s, st, e) for s, st, e in zip(b.shapes, b.strides,
                                                                   b.elements)]
        else:
            out = [buf[o:o + n].view(d).view(s)
                   for o, n, d, s in zip(b.offsets, b.sizes, b.torch_dtypes, b.shapes)]
        sums = flat_checksums(buf, b.offsets, b.sizes)
        if b.strides is not None and b.total % b.torch_dtypes[0].itemsize == 0:
            # padding is zero: one sum of the whole bucket is NaN or inf when any value is (and,
            # rarely, when finite values overflow it: the caller then looks value by value).
            # A reduction runs at the memory's speed; isfinite(...).all() at a third of it.
            dtype = b.torch_dtypes[0]
            finite = torch.isfinite(buf[:b.total].view(dtype).sum(
                dtype=torch.float64 if dtype == torch.float64 else torch.float32))
        else:
            finite = torch.stack([torch.isfinite(t).all() for t in out]).all()
        return out, sums, finite

    def _check_stream(self):
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def _update_buckets(self, payload: dict, layout: _Layout, ack) -> dict:
        """The whole update in one request: {buckets: [{names, dtypes, shapes}, ...],
        group_name, weight_version, update_id, pause_generation, load_format="flattened_bucket"}
        (over the update channel, ``layout`` is that list already parsed).

        Every bucket's receive is posted at once (the sender keeps several in flight). Over NCCL
        the host never waits per bucket: a side stream waits for each bucket's bytes and runs its
        checks (zero padding, per-tensor checksums, finite), and meanwhile the host takes the
        model lock (no generation or forward runs until the end) and points every parameter at
        its received tensor. Then the host waits for the checks, reads them once, and either
        keeps the new weights (the version moves) or points every parameter back (nothing
        changed). With ``ack`` (the update channel), a layout that cannot be committed is refused
        before any byte is sent, and ack() is called once it is accepted; without it (HTTP), the
        bytes are received and then refused, which keeps the group in step."""
        clock = time.perf_counter()
        group_name = str(payload.get("group_name"))
        self._require_group(group_name)
        if layout.problems and ack is not None:
            raise UpdateError("update refused before any byte was sent, previous weights kept: "
                              + "; ".join(layout.problems))
        version = _version_of(payload, self.version + 1)
        if ack is not None:
            ack()
        store, pg, backend, timeout_s = self._groups[group_name]
        nccl = backend == "nccl"
        seconds = {}
        staging = _Staging(payload.get("update_id"))
        posted, done = [], []
        timeline = [] if nccl and payload.get("timeline") else None  # GPU times, for benchmarks
        try:
            device = self.device if nccl else torch.device("cpu")
            stream = self._check_stream() if nccl else None
            if timeline is not None:
                timeline.append(_record(stream, True))
            posted = [self._post_flat(pg, device, b.total) for b in layout.buckets]
            seconds["post"] = time.perf_counter() - clock
            for b, names, (buf, work) in zip(layout.buckets, layout.canonical, posted):
                if nccl:
                    with torch.cuda.stream(stream):
                        work.wait()  # the side stream waits for the bytes; the host does not
                        if timeline is not None:
                            timeline.append(_record(stream, True))
                        out, sums, finite = self._unpack_flat(buf, b)
                    done.append(_record(stream, timeline is not None))
                else:
                    wait_work(work, backend, timeout_s)
                    out, sums, finite = self._unpack_flat(buf.to(self.device), b)
                staging.tensors.update(zip(names, out))
                staging.sums.append((names, sums))
                staging.finite.append(finite)
            seconds["queue"] = time.perf_counter() - clock
            if layout.problems:  # HTTP: every byte taken, then refused
                self._wait_events(done, timeout_s)
                raise UpdateError("update rejected, previous weights kept: "
                                  + "; ".join(layout.problems))
            if not self._model_lock.acquire(timeout=timeout_s):
                raise UpdateError(f"update: a generation held the model for longer than the "
                                  f"group's timeout_s {timeout_s:g}; previous weights kept", 503)
        except UpdateError:
            self._wait_events(done, timeout_s, quiet=True)
            raise
        except Exception as exc:  # noqa: BLE001 - a dead or stalled sender
            self._retire(group_name)
            self._retired.append(posted)  # buffers may still be written: keep them alive
            raise UpdateError(f"receiving over group {group_name!r} failed: "
                              f"{type(exc).__name__}: {exc}; group dropped, previous weights "
                              f"kept", 500) from None
        previous: dict[str, torch.Tensor] = {}
        locked = True
        try:
            self._swap_in(staging.tensors, previous)  # nothing runs on the model meanwhile
            seconds["swap"] = time.perf_counter() - clock
            try:
                if not self._events_done(done, time.monotonic() + self.hold_s):
                    # a slow (or dead) sender: give the model back to generation while the
                    # bytes come, and take it again for the swap
                    self._swap_back(previous)
                    self._model_lock.release()
                    locked = False
                    self._wait_events(done, timeout_s)
                    if not self._model_lock.acquire(timeout=timeout_s):
                        raise UpdateError(f"update: a generation held the model for longer "
                                          f"than the group's timeout_s {timeout_s:g}; previous "
                                          f"weights kept", 503)
                    locked = True
                    self._swap_in(staging.tensors, previous)
            except UpdateError:
                raise
            except Exception as exc:  # noqa: BLE001 - the bytes did not come
                self._retire(group_name)
                self._retired.append(posted)
                raise UpdateError(f"receiving over group {group_name!r} failed: "
                                  f"{type(exc).__name__}: {exc}; group dropped, previous "
                                  f"weights kept", 500) from None
            seconds["wait"] = time.perf_counter() - clock
            flags = torch.stack(staging.finite).to(torch.int64)
            names = [n for batch, _ in staging.sums for n in batch]
            checksum = combine_on_device(torch.cat([v for _, v in staging.sums]), names)
            values = torch.cat([flags, checksum.view(1)]).tolist()  # one read
            if not all(values[:len(flags)]):  # a bucket's sum is not finite: look closer
                bad = [n for n, t in staging.tensors.items() if not bool(torch.isfinite(t).all())]
                if bad:
                    raise UpdateError(f"update rejected, previous weights kept: tensors must be "
                                      f"finite, got NaN/inf in {bad[:3]}")
            self.version = version
        except BaseException:
            self._swap_back(previous)
            raise
        finally:
            if locked:
                self._model_lock.release()
        checksum = values[-1]
        self._staging = None
        self.last_error = None
        seconds["commit"] = time.perf_counter() - clock
        answer = {"success": True, "weight_version": version, "weights_checksum": checksum,
                  "message": f"updated {len(staging.tensors)} tensors to version {version}",
                  "seconds": seconds}
        if timeline is not None:  # ms from posting the receives: each bucket in, then checked
            answer["timeline"] = {
                "arrived_ms": [timeline[0].elapsed_time(e) for e in timeline[1:]],
                "checked_ms": [timeline[0].elapsed_time(e) for e in done]}
        return answer

    def _swap_in(self, tensors: dict[str, torch.Tensor], previous: dict) -> None:
        """Point each served parameter at its received tensor (model lock held); ``previous``
        gets what they pointed at."""
        for name, t in tensors.items():
            param = self.params[name]
            previous[name] = param.data
            param.data = t

    def _swap_back(self, previous: dict) -> None:
        for name, t in previous.items():
            self.params[name].data = t
        previous.clear()

    @staticmethod
    def _events_done(events, until: float) -> bool:
        """Whether every event completes before the monotonic time ``until`` (polled)."""
        for event in events:
            while not event.query():
                if time.monotonic() > until:
                    return False
                time.sleep(2e-5)
        return True

    @staticmethod
    def _wait_events(events, timeout_s: float, *, quiet: bool = False) -> None:
        """Poll each bucket's "checked" event in turn, each within ``timeout_s`` of the one before
        (the host is free meanwhile); TimeoutError after that, or nothing when ``quiet``."""
        for event in events:
            if not RolloutEngine._events_done([event], time.monotonic() + timeout_s):
                if quiet:
                    return
                raise TimeoutError(f"a bucket did not arrive within {timeout_s:g} s")

    def _commit(self, staging: _Staging, version: int, *, partial: bool) -> dict:
        """Validate the whole staging, then swap it in under the model lock (no copy: each
        parameter is pointed at its received tensor)."""
        tensors = {self.aliases.get(n, n): t for n, t in staging.tensors.items()}
        if not partial:
            missing = [n for n in self.params if n not in tensors]
            if missing:
                raise UpdateError(f"update rejected, previous weights kept: every parameter of "
                                  f"the served model must be sent, got none for {len(missing)} "
                                  f"(e.g. {missing[:3]})")
        if not staging.finite:  # from disk: checked here
            staging.finite = [torch.isfinite(t).all() for t in tensors.values()]
        if not bool(torch.stack([f.to(self.device) for f in staging.finite]).all()):
            bad = [n for n, t in tensors.items() if not bool(torch.isfinite(t).all())]
            raise UpdateError(f"update rejected, previous weights kept: tensors must be finite, "
                              f"got NaN/inf in {bad[:3]}")
        with self._model_lock:
            self._swap_in(tensors, {})
            self.version = version
            if not partial:
                rollout_lora.forget(self)
        if partial or not staging.sums:
            checksum = self.weights_checksum()
        else:
            names = [n for batch, _ in staging.sums for n in batch]
            values = torch.cat([v.to(self.device) for _, v in staging.sums]).tolist()
            checksum = combine_checksums(dict(zip(names, values)))
        self._staging = None
        self.last_error = None
        return {"success": True, "weight_version": version, "weights_checksum": checksum,
                "message": f"updated {len(tensors)} tensors to version {version}"}

    def update_from_ipc(self, payload: dict) -> dict:
        """/update_weights_from_ipc: {buckets: [{names, dtypes, shapes, handle}], weight_version,
        flush_cache}: each bucket's tensors packed back to back in a device buffer of a process
        on this GPU, named by its CUDA IPC handle (fsdpfn.weights.ipc); copied out here, checked
        and committed like a whole update. The sender frees the buffers after the answer."""
        with self._exclusive(0.0):
            try:
                return self._update_from_ipc(payload)
            except UpdateError as exc:
                self._fail(exc)
                raise

    def _update_from_ipc(self, payload: dict) -> dict:
        from fsdpfn.weights.ipc import open_shared, unpack

        if self.device.type != "cuda":
            raise UpdateError(f"update_weights_from_ipc: needs a server on a GPU, and this one "
                              f"runs on {self.device}")
        version = _version_of(payload, None)
        if version is None:
            raise UpdateError("weight_version: must be an int (or a string of one), got None")
        layout = _Layout(self, payload.get("buckets"))
        if layout.problems:
            raise UpdateError("update rejected, previous weights kept: "
                              + "; ".join(layout.problems[:8]))
        staging = _Staging(None)
        for spec, b in zip(payload["buckets"], layout.buckets):
            try:
                buffer = open_shared(spec.get("handle") or {}, self.device)
                tensors = unpack(buffer, b.torch_dtypes, b.shapes)
            except (ValueError, RuntimeError) as exc:
                raise UpdateError(f"update rejected, previous weights kept: {exc}") from None
            del buffer
            staging.tensors.update(zip(b.names, tensors))
        torch.cuda.synchronize(self.device)  # every copy done before the sender frees its buffers
        return self._commit(staging, version, partial=False)

    def load_lora_adapter(self, payload: dict) -> dict:
        """/load_lora_adapter (SGLang's payload): see fsdpfn.rollout.lora."""
        with self._exclusive(0.0):
            try:
                return rollout_lora.load_adapter(self, payload)
            except UpdateError as exc:
                self._fail(exc)
                raise

    def unload_lora_adapter(self, payload: dict) -> dict:
        """/unload_lora_adapter (SGLang's payload): see fsdpfn.rollout.lora."""
        with self._exclusive(0.0):
            return rollout_lora.unload_adapter(self, payload)

    def update_from_disk(self, payload: dict) -> dict:
        """/update_weights_from_disk: {model_path, weight_version, flush_cache, load_format,
        verify_checksums (default true: sha256 of each tensor against fsdpfn_manifest.json)}."""
        with self._exclusive(0.0):
            try:
                return self._update_from_disk(payload)
            except UpdateError as exc:
                self._fail(exc)
                raise

    def _update_from_disk(self, payload: dict) -> dict:
        path = Path(str(payload.get("model_path") or ""))
        if not path.is_dir():
            raise UpdateError(f"model_path: must be a directory of safetensors files, got "
                              f"{str(path)!r}", 404)
        manifest = _read_json(path / MANIFEST)
        version = _version_of(payload, None)
        if manifest is not None and version is not None and \
                int(manifest["version"]) != version:
            raise UpdateError(f"weight_version: must equal the manifest's version "
                              f"{manifest['version']} in {str(path)!r}, got {version}")
        if version is None:
            version = manifest["version"] if manifest is not None else self.version + 1
        staging = _Staging(None)
        tensors = _load_safetensors(path, self.device)
        problems = self._validate(list(tensors), [t.dtype for t in tensors.values()],
                                  [list(t.shape) for t in tensors.values()], staging)
        if manifest is not None and payload.get("verify_checksums", True):
            problems += _check_manifest(manifest, tensors)
        if problems:
            raise UpdateError(f"update from {str(path)!r} rejected, previous weights kept: "
                              + "; ".join(problems[:8]))
        staging.tensors = tensors
        return self._commit(staging, int(version), partial=False)


class _LogprobRecorder:
    """A forward hook on the HF model during generate(): at each decoding step it scores the
    token sampled at the previous step (the new input) under the previous step's distribution,
    so only one [B, V] distribution is ever kept (and, with ``top_n``, its top_n log-probs)."""

    def __init__(self, temperature: float, top_n: int = 0):
        self.temperature = temperature
        self.top_n = top_n
        self.previous: torch.Tensor | None = None
        self.steps: list[torch.Tensor] = []
        self.tops: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(self, module, args, kwargs, output) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if self.previous is not None:
            self.steps.append(self._score(ids[:, -1]))
        logits = output.logits[:, -1, :].float()
        self.previous = torch.log_softmax(logits / self.temperature, dim=-1)
        if self.top_n:
            values, index = self.previous.topk(min(self.top_n, self.previous.shape[-1]), -1)
            self.tops.append((values.cpu(), index.cpu()))

    def _score(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.previous.gather(-1, tokens.to(self.previous.device)[:, None])[:, 0].cpu()

    def finish(self, new_tokens: torch.Tensor) -> torch.Tensor:
        """(rows, L) log-probs of the generated tokens."""
        if self.previous is not None and len(self.steps) < new_tokens.shape[1]:
            self.steps.append(self._score(new_tokens[:, len(self.steps)]))
        assert len(self.steps) == new_tokens.shape[1], (len(self.steps), new_tokens.shape)
        return torch.stack(self.steps, dim=1)

    def top(self, length: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(values, ids), each (rows, L, top_n): the best log-probs at each generated position."""
        if not self.top_n:
            return None
        steps = self.tops[:length]
        return torch.stack([v for v, _ in steps], 1), torch.stack([i for _, i in steps], 1)


def _generation_config(sp: SamplingParams, width: int, pad_token_id: int):
    """(GenerationConfig, logits processors) of ``sp`` for HF generate. Sampling transforms are
    given as processors in HF's own order (temperature, top-k, top-p, min-p), after the
    penalties: SGLang penalises the logits before temperature."""
    from transformers import (GenerationConfig, LogitsProcessorList, MinPLogitsWarper,
                              TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)

    sample = sp.temperature > 0
    processors = LogitsProcessorList([Penalties(width, sp)] if sp.penalized else [])
    if sample:
        processors.append(TemperatureLogitsWarper(float(sp.temperature)))
        if sp.top_k > 0:
            processors.append(TopKLogitsWarper(int(sp.top_k)))
        if sp.top_p < 1:
            processors.append(TopPLogitsWarper(float(sp.top_p)))
        if sp.min_p > 0:
            processors.append(MinPLogitsWarper(float(sp.min_p)))
    config = GenerationConfig(
        do_sample=sample, max_new_tokens=sp.max_new_tokens,
        min_new_tokens=sp.min_new_tokens or None,
        eos_token_id=sp.stop_token_ids or None, pad_token_id=pad_token_id,
        return_dict_in_generate=True, use_cache=True,
        **({"temperature": 1.0, "top_p": 1.0, "top_k": 0} if sample else {}))
    return config, processors


def _version_of(payload: dict, default):
    """``weight_version`` of an update request as an int: an int, or (SGLang sends strings) a
    string of one; ``default`` when absent."""
    value = payload.get("weight_version")
    if value is None:
        return default
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise UpdateError(f"weight_version: must be an int or a string of one (fsdpfn "
                          f"versions count weight changes), got {value!r}")
    return value


def _load_text(model_path: str):
    try:
        return load_tokenizer(model_path)
    except Exception as exc:  # noqa: BLE001 - serve token ids without it
        import logging

        logging.getLogger("fsdpfn.rollout").warning(
            "no tokenizer loaded from %s (%s: %s): text fields are refused", model_path,
            type(exc).__name__, exc)
        return None


def _record(stream, timing: bool):
    event = torch.cuda.Event(enable_timing=timing)
    event.record(stream)
    return event


def _shut(sock) -> None:
    import socket

    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    with open(path) as fh:
        return json.load(fh)


def _load_safetensors(path: Path, device: torch.device) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UpdateError(f"model_path: must hold *.safetensors files, got none in "
                          f"{str(path)!r}", 404)
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(str(file), device=str(device)))
    return tensors


def _check_manifest(manifest: dict, tensors: dict[str, torch.Tensor]) -> list[str]:
    problems = []
    expected = manifest.get("tensors", {})
    if sorted(expected) != sorted(tensors):
        problems.append(f"files: must hold exactly the manifest's {len(expected)} tensors, got "
                        f"{len(tensors)}")
    for name, entry in expected.items():
        t = tensors.get(name)
        if t is not None and sha256_of(t) != entry.get("sha256"):
            problems.append(f"tensor {name!r}: sha256 must equal the manifest's, got a "
                            f"different digest (corrupted or partly written file)")
    return problems

