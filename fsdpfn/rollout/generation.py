"""The rollout engine's two generation paths (fsdpfn/rollout/engine.py calls them).

The decode loop (fsdpfn/rollout/decode.py): chosen for ``decode`` "loop", or "auto" on CUDA for a
model it serves; sized here (KV cache rows from the free memory); its limits are checked before a
request is queued (length, stop ids, and the options only HF generate implements, refused by
name). HF ``generate``: every sampling option of fsdpfn.rollout.sampling, the log-probs recorded
by a forward hook in the ``behav_logp`` convention (log_softmax(logits / T) at the sampled token,
before penalties and truncation), optionally the top log-probs of each position.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

from fsdpfn.rollout.errors import PAST_POSITIONS, UpdateError
from fsdpfn.rollout.sampling import Penalties, SamplingParams

__all__ = ["build_decoder", "check_decode", "hf_generate"]


def build_decoder(model, mode: str, rows: int | None, max_len: int, cuda_graphs: bool, *,
                  device: torch.device, lock: threading.Lock, version: Callable[[], int],
                  attention: str = "auto", compile: bool = False, rope_kv: str = "auto",
                  share_prefix: bool = True, kv_cache_dtype: str = "auto"):
    """The decode loop (fsdpfn/rollout/decode.py) for ``mode`` "loop", or "auto" on CUDA;
    None: HF ``generate`` (``mode`` "hf", or "auto" on CPU or for a model the loop does
    not serve, logged). ``lock`` and ``version``: the engine's model lock and served version."""
    from fsdpfn.rollout import decode
    from fsdpfn.rollout.slot_model import (ATTENTION, KV_CACHE_DTYPES, ROPE_KV, SlotModel,
                                           attention_refusal, config_head_dim)

    if mode not in ("auto", "hf", "loop"):
        raise UpdateError(f"decode: must be 'auto', 'hf' or 'loop', got {mode!r}")
    if attention not in ATTENTION:
        raise UpdateError(f"decode_attention: must be one of {ATTENTION}, got {attention!r}")
    if rope_kv not in ROPE_KV:
        raise UpdateError(f"decode_rope_kv: must be one of {ROPE_KV}, got {rope_kv!r}")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise UpdateError(f"kv_cache_dtype: must be one of {KV_CACHE_DTYPES}, got "
                          f"{kv_cache_dtype!r}")
    reason = attention_refusal(attention, device, next(model.parameters()).dtype,
                               config_head_dim(model.config))
    if reason:
        raise UpdateError(f"decode_attention: {reason}")
    # why HF generate serves instead of the loop (None: the loop serves)
    hf = (f"decode {mode!r} serves with HF generate on {device.type}"
          if mode == "hf" or (mode == "auto" and device.type != "cuda") else None)
    reason = None if hf else decode.unsupported_reason(model)
    if reason is not None:
        if mode == "loop":
            raise UpdateError(f"decode: 'loop' cannot serve this model "
                              f"({getattr(model.config, 'model_type', '?')}): {reason}; "
                              f"'auto' or 'hf' serves it with HF generate")
        hf = f"the loop cannot serve this model: {reason}"
    if hf is not None:
        if kv_cache_dtype != "auto":  # HF generate keeps its own cache in the model's dtype
            raise UpdateError(f"kv_cache_dtype: {kv_cache_dtype!r} is the decode loop's cache, "
                              f"and {hf}")
        if reason is not None:
            decode.log.warning("decode loop off (%s): generation uses HF generate", reason)
        return None
    max_len = min(int(max_len), int(getattr(model.config, "max_position_embeddings", max_len)))
    per_slot = SlotModel.kv_bytes_per_slot(model, max_len, kv_cache_dtype)
    if rows is None:  # half of the free memory for the KV cache, at most 1024 rows
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 64 * per_slot
        rows = max(8, min(1024, int(0.5 * free // per_slot) // 8 * 8))
    try:
        decoder = decode.Decoder(model, lock=lock, version=version, slots=int(rows),
                                 max_len=max_len, cuda_graphs=cuda_graphs, attention=attention,
                                 compile=compile, rope_kv=rope_kv, share_prefix=share_prefix,
                                 kv_cache_dtype=kv_cache_dtype)
    except ValueError as exc:  # the kernel or cache asked for by name cannot run here
        if str(exc).startswith("rope_kv: "):
            raise UpdateError(f"decode_{exc}") from None
        if str(exc).startswith("kv_cache_dtype: "):
            raise UpdateError(str(exc)) from None
        raise
    decode.log.warning("decode loop on: %d rows x %d positions (%.1f GB of %s KV cache), CUDA "
                       "graphs %s, %s attention, %s rotary and KV writes%s%s", rows, max_len,
                       rows * per_slot / 1e9,
                       str(decoder.net.kv_dtype).removeprefix("torch."),
                       "on" if decoder.use_graphs else "off",
                       decoder.net.attention, decoder.net.rope_kv,
                       ", shared prompts read once" if decoder.net.share_prefix else "",
                       ", compiled step" if compile else "")
    return decoder


def check_decode(decoder, prompts: list[list[int]], sp: SamplingParams,
                 top_logprobs: int = 0) -> None:
    """UpdateError naming the field when the decode loop cannot serve this request."""
    from fsdpfn.rollout.decode import MAX_STOPS

    limit = decoder.max_len
    longest = max(len(p) for p in prompts)
    if longest + sp.max_new_tokens > limit:
        raise UpdateError(f"sampling_params.max_new_tokens: prompt length plus "
                          f"max_new_tokens must be <= the server's decode max length "
                          f"{limit} {PAST_POSITIONS}, got {longest} + "
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


def hf_generate(model, prompts: list[list[int]], sp: SamplingParams, top_logprobs: int = 0, *,
                pad_token_id: int, device: torch.device,
                aborted: set[int] | None = None) -> list[dict]:
    """n outputs per prompt, prompt-major, by HF ``generate`` (the caller holds the model
    lock): {prompt_index, output_ids, output_logprobs, finish_reason, output_top_logprobs (with
    ``top_logprobs`` > 0)}. ``aborted``: row indices another thread may mark while it runs
    (RolloutEngine.abort); a marked row stops with the tokens it has, finish_reason "abort"
    (none when marked before the first token)."""
    rows = [p for p in prompts for _ in range(sp.n)]  # n samples per prompt, prompt-major
    width = max(len(p) for p in rows)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, p in enumerate(rows):  # left padding: every prompt ends at the same column
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    config, processors = _generation_config(sp, width, pad_token_id)
    if sp.seed is not None and sp.temperature > 0:  # each row draws from its own seed
        config.do_sample = False  # the last processor leaves only the drawn token
        for key in ("temperature", "top_p", "top_k"):
            setattr(config, key, None)
        processors.append(_SeededDraw(sp.seed, len(prompts), sp.n, width))
    recorder = _LogprobRecorder(sp.temperature if sp.temperature > 0 else 1.0, top_logprobs)
    from transformers import StoppingCriteriaList

    stopper = _AbortedRows(set() if aborted is None else aborted, width)
    handle = model.register_forward_hook(recorder, with_kwargs=True)
    # a seed draws from a generator state of its own: the process's, which later unseeded
    # requests draw from, is restored after the call
    devices = [device] if torch.device(device).type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices, enabled=sp.seed is not None), \
                torch.no_grad():
            if sp.seed is not None:
                torch.manual_seed(int(sp.seed))
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                 generation_config=config, logits_processor=processors,
                                 stopping_criteria=StoppingCriteriaList([stopper]))
    finally:
        handle.remove()
    new = out.sequences[:, width:].cpu()  # (B*n, L)
    return _outputs(new, recorder.finish(new), recorder.top(new.shape[1]), sp, stopper.ends)


class _AbortedRows:
    """HF generate's stopping criterion for the rows marked aborted: each ends where it is
    when first seen marked (``ends``: row -> its tokens kept; 0 when marked before the
    first)."""

    def __init__(self, aborted: set[int], width: int):
        self.aborted, self.width = aborted, width
        self.ends = {row: 0 for row in list(aborted)}

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        for row in list(self.aborted):
            if row < input_ids.shape[0]:
                self.ends.setdefault(row, input_ids.shape[1] - self.width)
                done[row] = True
        return done


class _SeededDraw:
    """The last logits processor of a seeded HF generate: each row draws its token by the
    exponential race with noise from its own seed (fsdpfn.rollout.device_sampling: prompt
    ``i``, sample ``j`` of a request seeded ``s`` draws with row_seed(s, i, j), keyed by the
    token's index) over the scores the warpers before it left, and only that token stays
    finite. A row's tokens then depend on its seed, prompt index and logits, never on what
    else is batched (one torch generator for the whole batch would tie them together)."""

    def __init__(self, seed: int, n_prompts: int, n: int, width: int):
        from fsdpfn.rollout.device_sampling import row_seed

        self.seeds = torch.tensor([row_seed(seed, i, j) for i in range(n_prompts)
                                   for j in range(n)], dtype=torch.long)
        self.width = width

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        from fsdpfn.rollout.device_sampling import seeded_exponential

        seeds = self.seeds.to(scores.device)
        steps = torch.full_like(seeds, input_ids.shape[1] - self.width)
        noise = seeded_exponential(seeds, steps, scores.float())
        token = (scores.float() - noise.log()).argmax(-1, keepdim=True)
        return torch.full_like(scores, float("-inf")).scatter(-1, token, 0.0)


def _outputs(new: torch.Tensor, logps: torch.Tensor, tops, sp: SamplingParams,
             ends: dict[int, int] | None = None) -> list[dict]:
    """new[B*n, L] generated tokens, logps[B*n, L], tops (values, ids) or None: each row cut
    after its first stop token id, or at its ``ends`` entry (an aborted row) when that comes
    first."""
    stops = set(sp.stop_token_ids)
    ends = ends or {}
    results = []
    for row in range(new.shape[0]):
        tokens = new[row].tolist()
        end, reason = len(tokens), "length"
        for j, t in enumerate(tokens):
            if t in stops:
                end, reason = j + 1, "stop"
                break
        limit = ends.get(row)
        if limit is not None and (limit < end or (
                limit == end and reason == "length" and end < sp.max_new_tokens)):
            # (ending with the batch's last row is not reaching max_new_tokens)
            end, reason = limit, "abort"
        results.append({"prompt_index": row // sp.n, "output_ids": tokens[:end],
                        "output_logprobs": logps[row, :end].tolist(),
                        "finish_reason": reason})
        if tops is not None:
            values, index = tops
            results[-1]["output_top_logprobs"] = [
                [[v, i] for v, i in zip(vs, ix)]
                for vs, ix in zip(values[row, :end].tolist(), index[row, :end].tolist())]
    return results


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


def neutral_generation_config(model):
    """transformers' default GenerationConfig (no penalty, no truncation, no forced or
    suppressed tokens) with the model's own token ids: what ``generate`` may fill a request's
    unset fields from without changing the request's distribution."""
    from transformers import GenerationConfig

    own = getattr(model, "generation_config", None)
    ids = {key: getattr(own, key, None) for key in ("bos_token_id", "eos_token_id",
                                                     "pad_token_id", "decoder_start_token_id")}
    return GenerationConfig(**{k: v for k, v in ids.items() if v is not None})


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
        # the request's stop ids, and no others: None would let generate fall back to the
        # model's own eos ids, which a request with ignore_eos has asked to pass
        eos_token_id=list(sp.stop_token_ids), pad_token_id=pad_token_id,
        return_dict_in_generate=True, use_cache=True,
        **({"temperature": 1.0, "top_p": 1.0, "top_k": 0} if sample else {}))
    return config, processors
