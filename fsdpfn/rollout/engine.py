"""RolloutEngine: the model a rollout server serves, its generation, and its atomic weight updates.

Everything here is plain Python (no HTTP), so it can be tested and embedded directly.

Concurrency. ``_model_lock`` is held by every generation or forward while it runs, and by
``swap``, the one way the served weights change; so a request sees one weights version from start
to end (its response names it).
``pause()`` makes new generation requests wait and returns once none is running;
``resume()`` lets them go. A pause expires by itself after ``max_pause_s`` (a trainer that died
between pause and continue cannot stall the server), and a failed update resumes generation.
``abort(rid, abort_all)`` (SGLang's /abort_request) ends the named requests' outputs, or every
request's: waiting for a pause or for the model, queued or decoding, each output ends with the
tokens it has (none when it had not started) and finish_reason "abort".

Generation runs the decode loop or HF generate (fsdpfn.rollout.generation picks, sizes and checks
them). Weight updates are the receiver's (``engine.receiver``, fsdpfn.rollout.receiver): it owns
the groups, channels, turns and failures, checks what arrives, and hands finished tensors to
``swap``.

Versions. ``version`` is fsdpfn's integer count of weight changes; an update may also name its
weights with any string (SGLang's ``weight_version``), reported back as given by
``version_label`` (the integer as a string when none was given).

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

from fsdpfn.rollout import generation
from fsdpfn.rollout.errors import UpdateError, check_temperature
from fsdpfn.rollout.receiver import Receiver
from fsdpfn.rollout.sampling import SamplingParams, find_stop
from fsdpfn.rollout.text import eos_ids, load_tokenizer
from fsdpfn.wire.model_fingerprint import config_fields, config_fingerprint
from fsdpfn.wire.protocol import combine_checksums, dtype_from_name, dtype_name, tensor_checksums

__all__ = ["RolloutEngine", "UpdateError", "SamplingParams"]

# rows one request may ask for: every row is built before the first token (HF generate pads
# them into one batch), so a request of 10**9 rows would take the server's memory down
MAX_REQUEST_ROWS = 65_536


def _attention_for(model_path: str) -> str:
    """HF's SDPA attention, or its eager one for a family transformers refuses SDPA for, and
    wherever the config softcaps the attention logits (SDPA has no softcap: transformers before
    5.21 let Gemma-2 run SDPA and dropped the cap, 5.7e-4 nats off on the tests' tiny model)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return "eager"
    cls = AutoModelForCausalLM._model_mapping.get(type(config), None)  # noqa: SLF001
    return "sdpa" if getattr(cls, "_supports_sdpa", True) else "eager"


def _placeholder_model(model_path: str, kwargs: dict, device: torch.device):
    """The model of ``model_path``'s config.json built on ``device`` with HF's init (SGLang's
    ``--load-format dummy``): weights of the right names, shapes and dtype, and the buffers HF
    computes (rotary frequencies), for a trainer that pushes its own weights first."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    dtype = kwargs["dtype"]
    if dtype == "auto":
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) \
            or torch.float32
        dtype = dtype_from_name(dtype) if isinstance(dtype, str) else dtype
    with torch.device(device):
        return AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=kwargs["attn_implementation"])


class RolloutEngine:
    def __init__(self, model_path: str, *, dtype: str = "auto", device: str = "cpu",
                 load_format: str = "auto", weight_version: int = 0, max_pause_s: float = 600.0,
                 decode: str = "auto",
                 decode_rows: int | None = None, decode_max_len: int = 2048,
                 cuda_graphs: bool = True, fused_kernels: bool = True,
                 decode_attention: str = "auto", decode_compile: bool = False,
                 decode_rope_kv: str = "auto", decode_share_prefix: bool = True,
                 kv_cache_dtype: str = "auto"):
        from transformers import AutoModelForCausalLM

        self.model_path = str(model_path)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        kwargs: dict[str, Any] = {"attn_implementation": _attention_for(self.model_path)}
        kwargs["dtype"] = "auto" if dtype == "auto" else dtype_from_name(dtype)
        self.load_format = load_format
        if load_format == "dummy":  # built on the device: a push brings the weights
            model = _placeholder_model(self.model_path, kwargs, self.device)
        elif load_format == "auto":
            model = AutoModelForCausalLM.from_pretrained(self.model_path, **kwargs)
        else:
            raise ValueError(f"load_format: must be 'auto' or 'dummy', got {load_format!r}")
        self.model = model.to(self.device).eval().requires_grad_(False)
        # generate fills every field a request leaves unset from the model's own
        # generation_config.json (a repetition_penalty of 1.05, a top_k of 20, ...): the served
        # distribution is the request's alone, so the model's defaults are HF's neutral ones
        self.model.generation_config = generation.neutral_generation_config(self.model)
        if fused_kernels:  # Liger's fused RMSNorm and SwiGLU, as the trainer runs by default
            from fsdpfn.wire.kernels import apply_fused_kernels

            self.fused = apply_fused_kernels(self.model, self.model.config, self.device.type,
                                             keep_weights=True)
            self.model.eval().requires_grad_(False)  # the swapped-in modules too
        else:
            self.fused = 0
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
        self._tickets: set[_Ticket] = set()  # the generation requests not yet answered
        self._labels: dict[int, str] = {}  # version -> the label an update gave it (recent)
        self.server_id = uuid.uuid4().hex  # changes when the server restarts
        self.kv_cache_dtype = kv_cache_dtype  # "auto" (the model's dtype) or "fp8_e4m3"
        self._decoder = generation.build_decoder(
            self.model, decode, decode_rows, decode_max_len, cuda_graphs, device=self.device,
            lock=self._model_lock, version=lambda: self.version, attention=decode_attention,
            compile=decode_compile, rope_kv=decode_rope_kv, share_prefix=decode_share_prefix,
            kv_cache_dtype=kv_cache_dtype)
        self.tokenizer = _load_text(self.model_path)  # None: text fields are refused
        self.eos_ids = eos_ids(self.model_path, self.tokenizer)
        self.receiver = Receiver(self)  # the update state (groups, channels, turns, failures)

    # ------------------------------------------------------------ info

    @property
    def dtype(self) -> torch.dtype:
        return next(iter(self.params.values())).dtype

    def version_label(self, version: int | None = None) -> str:
        """The name of weights ``version`` (default: the served one): the string an update gave
        it, else the integer as a string."""
        version = self.version if version is None else version
        return self._labels.get(version, str(version))

    def info(self) -> dict:
        """SGLang's model info (weight_version: the label), then fsdpfn's (version: the int).

        ``model_type``, ``config_fields`` and ``config_fingerprint``
        (fsdpfn.wire.model_fingerprint) say what the served forward computes beyond its
        tensors' names and shapes (rope, windows, norm eps, softcaps, scales): a trainer whose
        config differs there is refused before it sends a byte (the push's precheck)."""
        fields = config_fields(self.model.config)
        return {"model_path": self.model_path, "load_format": self.load_format,
                "model_type": fields.get("model_type"), "config_fields": fields,
                "config_fingerprint": config_fingerprint(fields),
                "server_id": self.server_id,
                "dtype": dtype_name(self.dtype), "device": str(self.device),
                "weight_version": self.version_label(), "version": self.version,
                "ipc": self.device.type == "cuda", "fused_modules": self.fused,
                "is_generation": True, "vocab_size": self.vocab_size,
                "paused": self._paused, **self.receiver.info(),
                "decode": "hf" if self._decoder is None else (
                    f"loop ({self._decoder.slots} rows x {self._decoder.max_len}, CUDA graphs "
                    f"{'on' if self._decoder.use_graphs else 'off'}, "
                    f"{self._decoder.net.attention} attention, "
                    f"{dtype_name(self._decoder.net.kv_dtype)} KV cache)"),
                "kv_cache_dtype": self.kv_cache_dtype,
                "decode_stats": None if self._decoder is None else {
                    "steps": self._decoder.steps, "seconds": self._decoder.step_seconds,
                    "graphs": len(self._decoder.graphs),
                    "shared_steps": self._decoder.shared_steps,
                    "prefill_seconds": self._decoder.prefill_seconds,
                    "prefill_prompts": self._decoder.prefill_prompts},
                "tokenizer_path": self.model_path if self.tokenizer is not None else None,
                "preferred_sampling_params": None, "eos_token_ids": self.eos_ids,
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

    def _enter_generation(self, ticket: "_Ticket | None" = None) -> bool:
        """Wait while paused; False (not entered) when ``ticket``'s every output was aborted
        meanwhile."""
        with self._gen_cond:
            while self._paused and not (ticket is not None and ticket.all_aborted()):
                self._gen_cond.wait()
            if ticket is not None and ticket.all_aborted():
                return False
            self._active += 1
            return True

    def abort(self, rid: str | None = None, abort_all: bool = False) -> int:
        """SGLang's /abort_request: the outputs of the requests whose ``rid`` matches (a
        request's rid, or one output's in a list of them), or of every request with
        ``abort_all``, end where they are with finish_reason "abort". Returns how many outputs
        were marked (0: no running or waiting request matched, as SGLang ignores an unknown
        rid)."""
        marked = 0
        with self._gen_cond:
            for ticket in self._tickets:
                marked += ticket.mark(rid, abort_all)
            self._gen_cond.notify_all()  # requests waiting for a pause
        if marked and self._decoder is not None:
            self._decoder.wake()
        return marked

    def busy(self) -> bool:
        """Whether a generation request is running or waiting."""
        with self._gen_cond:
            return bool(self._tickets)

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
            if not isinstance(row, list) or not row or not all(
                    isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size
                    for t in row):
                raise UpdateError(f"{what}[{i}]: must be a non-empty list of ints in "
                                  f"[0, {self.vocab_size}), got {str(row)[:80]}")
            out.append(row)
        return out

    @property
    def context(self) -> int:
        """Positions the model takes (max_position_embeddings; 2048 when its config has none)."""
        return int(getattr(self.model.config, "max_position_embeddings", None) or 2048)

    def _within_context(self, prompts: list[list[int]], sp: SamplingParams) -> SamplingParams:
        """A prompt must leave the model a position to generate in; max_new_tokens is capped at
        what the longest prompt leaves (its outputs then finish by length), as SGLang does."""
        for i, row in enumerate(prompts):
            if len(row) >= self.context:
                raise UpdateError(f"input_ids[{i}]: must be shorter than the model's context "
                                  f"(max_position_embeddings = {self.context}), got "
                                  f"{len(row)} tokens")
        room = self.context - max(len(row) for row in prompts)
        return sp.capped(room) if room < sp.max_new_tokens else sp

    def generate(self, input_ids: list, sampling: SamplingParams, *,
                 top_logprobs: int = 0, lists: bool = True,
                 rid: str | list | None = None) -> dict:
        """Returns {"weight_version", "outputs": [{"prompt_index", "output_ids",
        "output_logprobs", "finish_reason" ("stop" | "length"), "matched" (the stop token id or
        stop string, when "stop"), "weight_versions", "output_top_logprobs" (with
        ``top_logprobs`` > 0: per token, [[logprob, token_id], ...] best first)}]}, n outputs
        per prompt, prompt-major. ``weight_versions``: the weights version that produced each
        token; ``weight_version``: the oldest of them (the only one unless weights were swapped
        while the request ran in the decode loop, which swaps between steps). ``lists=False``:
        the decode loop's ids and log-probs stay as it read them, a CPU tensor a row (int64,
        float32), for packing them as bytes without lists in between (the server's packed
        answer, fsdpfn/rollout/packing.py); HF generate's are lists either way. ``rid``: the
        request's id (a string for every output, or a list of one per output, None where an
        output has none), what ``abort`` matches; an aborted output's finish_reason is
        "abort"."""
        prompts = self._check_ids(input_ids, "input_ids")
        if len(prompts) * sampling.n > MAX_REQUEST_ROWS:  # before any row is built
            raise UpdateError(f"sampling_params.n: a request's rows (prompts x n) must be <= "
                              f"{MAX_REQUEST_ROWS}, got {len(prompts)} x {sampling.n}; send "
                              f"the prompts in several requests")
        beyond = [t for t in sampling.stop_token_ids
                  if t >= self.vocab_size and t not in self.eos_ids]
        if beyond:  # an id the model cannot sample never stops a row
            raise UpdateError(f"sampling_params.stop_token_ids: must be ids the model samples, "
                              f"in [0, {self.vocab_size}), got {beyond[0]}")
        sampling = self._within_context(prompts, sampling)
        if sampling.stop and self.tokenizer is None:
            raise UpdateError("sampling_params.stop: stop strings need a tokenizer, and the "
                              f"model directory {self.model_path!r} has none")
        if self._decoder is not None:
            generation.check_decode(self._decoder, prompts, sampling, top_logprobs)
        ticket = _Ticket(rid, len(prompts) * sampling.n)
        with self._gen_cond:
            self._tickets.add(ticket)
        try:
            outputs, version = self._generate(prompts, sampling, top_logprobs, ticket)
        finally:
            with self._gen_cond:
                self._tickets.discard(ticket)
        for o in outputs:
            if lists or sampling.stop:  # stop strings are matched on lists
                for key in ("output_ids", "output_logprobs"):
                    if not isinstance(o[key], list):
                        o[key] = o[key].tolist()
            self._finish(o, sampling)
        return {"weight_version": version, "outputs": outputs}

    def _generate(self, prompts: list[list[int]], sampling: SamplingParams, top_logprobs: int,
                  ticket: "_Ticket") -> tuple[list[dict], int]:
        if not self._enter_generation(ticket):  # aborted while a pause held it
            return [{"prompt_index": i // sampling.n, "output_ids": [], "output_logprobs": [],
                     "finish_reason": "abort", "weight_versions": []}
                    for i in range(ticket.size)], self.version
        try:
            if self._decoder is not None:
                outputs = self._decoder.generate(prompts, sampling, ticket.aborted)
                version = min(min(o["weight_versions"] or [self.version]) for o in outputs)
            else:
                with self._model_lock:
                    version = self.version
                    outputs = generation.hf_generate(self.model, prompts, sampling,
                                                     top_logprobs,
                                                     pad_token_id=self.pad_token_id,
                                                     device=self.device,
                                                     aborted=ticket.aborted)
                for o in outputs:
                    o["weight_versions"] = [version] * len(o["output_ids"])
        finally:
            self._leave_generation()
        return outputs, version

    def _finish(self, o: dict, sp: SamplingParams) -> None:
        """Cut an output at its first stop string (stop strings are matched on the finished
        tokens, on both generation paths); name what stopped it."""
        if o["finish_reason"] == "stop":
            o["matched"] = int(o["output_ids"][-1])
        hit = find_stop(o["output_ids"], self.tokenizer.decode, sp.stop,
                        sp.min_new_tokens) if sp.stop else None
        if hit is not None and (hit[0] < len(o["output_ids"]) or o["finish_reason"] != "stop"):
            end, o["matched"], o["finish_reason"] = hit[0], hit[1], "stop"
            for key in ("output_ids", "output_logprobs", "weight_versions",
                        "output_top_logprobs"):
                if key in o:
                    o[key] = o[key][:end]

    def forward(self, input_ids: list, *, temperature: float = 1.0,
                return_logits: bool = False) -> dict:
        """Teacher-forced scoring: token_logprobs[b][t] = log softmax(logits/T) of ids[t] given
        ids[:t] (0 at t=0); logits [b][t][V] when asked (ragged rows, no padding)."""
        rows = self._check_ids(input_ids, "input_ids")
        temperature = check_temperature(temperature)
        if not isinstance(return_logits, bool):
            raise UpdateError(f"return_logits: must be a bool, got {return_logits!r}")
        if len(rows) > MAX_REQUEST_ROWS:
            raise UpdateError(f"input_ids: at most {MAX_REQUEST_ROWS} rows a request, got "
                              f"{len(rows)}; send them in several requests")
        for i, row in enumerate(rows):
            if len(row) > self.context:
                raise UpdateError(f"input_ids[{i}]: must fit the model's context "
                                  f"(max_position_embeddings = {self.context}), got "
                                  f"{len(row)} tokens")
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

    # ------------------------------------------------------------ the one swap

    def swap(self, tensors: dict[str, torch.Tensor], version: int, *, label: str | None = None,
             timeout_s: float = 300.0) -> None:
        """The one way the served weights change: under the model lock (no generation or
        forward runs meanwhile; the decode loop swaps between two steps), each served parameter
        named in ``tensors`` (served names) is pointed at its tensor, no copy, and the version
        (with its ``label``, if any) moves. The caller has checked the tensors."""
        if not self._model_lock.acquire(timeout=timeout_s):
            raise UpdateError(f"update: a generation held the model for longer than "
                              f"{timeout_s:g} s; previous weights kept", 503)
        try:
            self._swap_in(tensors, {})
            self.version = int(version)
            self._labels.pop(self.version, None)
            if label is not None:
                self._labels = {v: k for v, k in self._labels.items() if v > version - 64}
                self._labels[self.version] = str(label)
        finally:
            self._model_lock.release()

    def _swap_in(self, tensors: dict[str, torch.Tensor], previous: dict) -> None:
        """Point each served parameter at its tensor (model lock held); ``previous`` gets what
        they pointed at."""
        for name, t in tensors.items():
            param = self.params[name]
            previous[name] = param.data
            param.data = t


class _Ticket:
    """One generation request's outputs as ``abort`` sees them: each output's rid and the
    indices (prompt-major) marked aborted, a set the generation path reads as it runs."""

    def __init__(self, rid, size: int):
        self.size = size
        # a list names the outputs in order; one shorter leaves the rest without a rid
        self.rids = (list(rid[:size]) + [None] * (size - len(rid))) if isinstance(rid, list) \
            else [rid] * size
        self.aborted: set[int] = set()

    def mark(self, rid: str | None, abort_all: bool) -> int:
        new = {i for i, r in enumerate(self.rids)
               if abort_all or (rid is not None and r == rid)} - self.aborted
        self.aborted |= new
        return len(new)

    def all_aborted(self) -> bool:
        return len(self.aborted) >= self.size


def _load_text(model_path: str):
    try:
        return load_tokenizer(model_path)
    except Exception as exc:  # noqa: BLE001 - serve token ids without it
        import logging

        logging.getLogger("fsdpfn.rollout").warning(
            "no tokenizer loaded from %s (%s: %s): text fields are refused", model_path,
            type(exc).__name__, exc)
        return None

