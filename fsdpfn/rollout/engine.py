"""RolloutEngine: the model a rollout server serves, its generation, and its atomic weight updates.

Everything here is plain Python (no HTTP), so it can be tested and embedded directly.

Concurrency. ``_model_lock`` is held by every generation or forward while it runs, and by the swap
of an update; so a request sees one weights version from start to end (its response names it).
``pause()`` makes new generation requests wait and returns once none is running;
``resume()`` lets them go. A pause expires by itself after ``max_pause_s`` (a trainer that died
between pause and continue cannot stall the server), and a failed update resumes generation.

Weight updates (groups, staging, swap, verify, commit) live in fsdpfn.rollout.updates and its
stages (groups.py, staging.py); the methods below only delegate to them.

behav_logp convention: the log-prob of each sampled token is log_softmax(logits / temperature)
at that token: temperature applied, top-p / top-k truncation not (it is what the trainer's
``forward_logp(..., temperature=T)`` computes for the same weights and tokens). Greedy decoding
(temperature 0) reports log_softmax(logits).
"""

from __future__ import annotations

import threading
import uuid
from typing import Any, Sequence

import torch

from fsdpfn.rollout import groups, updates
from fsdpfn.rollout import staging as stages
from fsdpfn.rollout.errors import UpdateError
from fsdpfn.rollout.sampling import Penalties, SamplingParams, find_stop
from fsdpfn.rollout.staging import Staging
from fsdpfn.rollout.text import eos_ids, load_tokenizer
from fsdpfn.wire.protocol import combine_checksums, dtype_from_name, dtype_name, tensor_checksums

__all__ = ["RolloutEngine", "UpdateError", "SamplingParams"]


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
        self._staging: Staging | None = None
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

    # ------------------------------------------------------------ weight updates (updates.py)

    def init_group(self, payload: dict) -> dict:
        """/init_weights_update_group (see fsdpfn.rollout.groups.init_group)."""
        return groups.init_group(self, payload)

    def destroy_group(self, name: str) -> dict:
        return groups.destroy_group(self, name)

    def attach_channel(self, group_name: str, sock) -> None:
        groups.attach_channel(self, group_name, sock)

    def detach_channel(self, sock) -> None:
        groups.detach_channel(self, sock)

    def update_from_distributed(self, payload: dict, *, layout=None, ack=None) -> dict:
        """/update_weights_from_distributed (see fsdpfn.rollout.updates)."""
        return updates.update_from_distributed(self, payload, layout=layout, ack=ack)

    def update_from_ipc(self, payload: dict) -> dict:
        """/update_weights_from_ipc (see fsdpfn.rollout.updates)."""
        return updates.update_from_ipc(self, payload)

    def update_from_disk(self, payload: dict) -> dict:
        """/update_weights_from_disk (see fsdpfn.rollout.updates)."""
        return updates.update_from_disk(self, payload)

    def load_lora_adapter(self, payload: dict) -> dict:
        """/load_lora_adapter (SGLang's payload): see fsdpfn.rollout.lora."""
        return updates.load_lora_adapter(self, payload)

    def unload_lora_adapter(self, payload: dict) -> dict:
        """/unload_lora_adapter (SGLang's payload): see fsdpfn.rollout.lora."""
        return updates.unload_lora_adapter(self, payload)

    def _swap_in(self, tensors: dict[str, torch.Tensor], previous: dict) -> None:
        """Point each served parameter at its tensor (model lock held); see staging.swap_in."""
        stages.swap_in(self, tensors, previous)

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


def _load_text(model_path: str):
    try:
        return load_tokenizer(model_path)
    except Exception as exc:  # noqa: BLE001 - serve token ids without it
        import logging

        logging.getLogger("fsdpfn.rollout").warning(
            "no tokenizer loaded from %s (%s: %s): text fields are refused", model_path,
            type(exc).__name__, exc)
        return None

