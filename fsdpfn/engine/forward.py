"""forward_logp and compute_values: read-only, micro-batched forwards over packed sequences.

Data path: validate the public batch (every rank agrees on the verdict) -> plan micro-batches by
token budget (count agreed over all ranks) -> pack each micro-batch without padding -> PackedModel
-> token-aligned results scattered back into [B, T]. The micro-batch runner is fsdpfn.engine.runner.
"""

from __future__ import annotations

import contextlib

import torch

from fsdpfn import keys as K
from fsdpfn.engine import lora
from fsdpfn.engine import timing
from fsdpfn.batch import Packed, apply_scatter, pack
from fsdpfn.config import MicroBatchSpec
from fsdpfn.errors import ConfigError
from fsdpfn.validators import check_temperature
from fsdpfn.engine.runner import (empty_packed, model_outputs, oom_error, plan, prepare,
                                  release_memory, resolve_mb_spec, rope_top)
from fsdpfn.agree import same_on_every_rank
from fsdpfn.engine.state import EngineState, check_live

__all__ = ["forward_logp", "compute_values", "compute_scores"]


def _check_temperature(temperature) -> float:
    if temperature is None:
        return 1.0
    return check_temperature(temperature)


def _mb_packs(state, batch, spec: MicroBatchSpec) -> list[Packed]:
    return [pack(batch, rows=rows) if rows else empty_packed(batch)
            for rows in plan(state, batch, mb_spec=spec)]


def _check_out_key(out_key, *, with_entropy: bool = False) -> None:
    if not isinstance(out_key, str) or not out_key:
        raise ConfigError(f"out_key: must be a non-empty string, got {out_key!r}")
    if out_key in K.INPUT_KEYS or (with_entropy and out_key == K.ENTROPY):
        taken = K.INPUT_KEYS + ((K.ENTROPY,) if with_entropy else ())
        raise ConfigError(f"out_key: must not name a key the engine reads or writes "
                          f"({', '.join(taken)}), got {out_key!r}; use e.g. 'logp', "
                          f"'old_logp' or 'ref_logp'")


def _scatter_outputs(state, batch, fn_name: str, spec: MicroBatchSpec, outs: list,
                     **kwargs) -> None:
    """model_outputs of every micro-batch written into ``outs`` ([B, T] tensors, or None).

    A device out-of-memory error becomes MicroBatchOOMError after memory is released (raised
    here, outside the except block, so the failed pass's tensors are already freed)."""
    failed = None
    with rope_top(state, batch):
        for packed in _mb_packs(state, batch, spec):
            timing.enter("forward")
            try:
                results = model_outputs(state, packed, **kwargs)
            except torch.OutOfMemoryError:
                failed = packed.n_tokens
                break
            timing.enter("plan")  # unpacking
            if packed.rows.numel():
                for out, x in zip(outs, results):
                    if out is not None:
                        apply_scatter(out, packed, x.cpu())
    if failed is not None:
        release_memory(state)
        raise oom_error(state, fn_name, failed, spec)


def _check_adapters(state, adapters) -> None:
    if not isinstance(adapters, bool):
        raise ConfigError(f"adapters: must be a bool, got {adapters!r}")
    if not adapters and isinstance(state, EngineState) and state.config.lora is None:
        raise ConfigError("adapters: False needs a state built with EngineConfig.lora (the base "
                          "model without its adapters), got a state without lora")


@timing.timed("forward_logp", passes=1, attach=False)
@torch.no_grad()
def forward_logp(state: EngineState, batch, *, out_key: str = K.LOGP, with_entropy: bool = False,
                 temperature: float | None = None, mb_spec: MicroBatchSpec | None = None,
                 adapters: bool = True):
    """Log-probs of input_ids under ``state``'s model: ``out_key`` [B, T] float32, 0 at t=0 and on
    padding (and ``"entropy"`` [B, T] when asked). Read-only: returns a new TensorDict.

    ``out_key`` may not name an input (input_ids, attention_mask, loss_mask, rewards, group_id,
    row_index). ``mb_spec`` overrides the state's micro-batching for this call.
    ``adapters=False`` (a state with ``lora``): the frozen base model alone, adapters disabled,
    e.g. ``ref_logp`` for a KL term with one model in memory.
    With ``EngineConfig.timing``, the call's stage times, peak memory, tokens/s and MFU are
    kept for ``fsdpfn.last_timings(state)["forward_logp"]`` (the returned batch is unchanged).
    """
    error, spec = None, None
    try:
        temperature = _check_temperature(temperature)
        _check_adapters(state, adapters)
        if not isinstance(with_entropy, bool):
            raise ConfigError(f"with_entropy: must be a bool, got {with_entropy!r}")
        _check_out_key(out_key, with_entropy=with_entropy)
        spec = resolve_mb_spec(state, mb_spec) if isinstance(state, EngineState) else None
    except ConfigError as exc:
        error = exc
    prepare(state, batch, "forward_logp", critic=False)
    check_live(state, "forward_logp", local_error=error)
    same_on_every_rank("forward_logp", {"out_key": out_key, "with_entropy": with_entropy,
                                        "temperature": temperature, "mb_spec": spec,
                                        "adapters": adapters})
    B, T = batch.get(K.INPUT_IDS).shape
    logp = torch.zeros(B, T, dtype=torch.float32)
    entropy = torch.zeros(B, T, dtype=torch.float32) if with_entropy else None
    was_training = state.model.training
    state.model.eval()
    try:
        with contextlib.nullcontext() if adapters else lora.adapters_disabled(state.model):
            _scatter_outputs(state, batch, "forward_logp", spec, [logp, entropy],
                             temperature=temperature, with_entropy=with_entropy)
    finally:
        state.model.train(was_training)
    out = batch.copy()
    out.set(out_key, logp.to(batch.device or "cpu"))
    if with_entropy:
        out.set(K.ENTROPY, entropy.to(batch.device or "cpu"))
    return out


@timing.timed("compute_values", passes=1, attach=False)
@torch.no_grad()
def compute_values(state: EngineState, batch, *, out_key: str = K.VALUES,
                   mb_spec: MicroBatchSpec | None = None):
    """Values of a critic state: ``out_key`` [B, T] float32 (0 on padding), token aligned like
    logp: values[t] is the head's output at token t-1. ``out_key`` may not name an input;
    ``mb_spec`` overrides the state's micro-batching for this call."""
    values = _critic_pass(state, batch, "compute_values", out_key, mb_spec, scores=False)
    return batch.copy().set(out_key, values.to(batch.device or "cpu"))


@timing.timed("compute_scores", passes=1, attach=False)
@torch.no_grad()
def compute_scores(state: EngineState, batch, *, out_key: str = "scores",
                   mb_spec: MicroBatchSpec | None = None):
    """Sequence scores of a critic state (a reward model): ``out_key`` [B] float32, the head's
    output at each row's last real token, which rw_step trains. ``out_key`` may not name an
    input; ``mb_spec`` overrides the state's micro-batching for this call."""
    per_token = _critic_pass(state, batch, "compute_scores", out_key, mb_spec, scores=True)
    last = batch.get(K.ATTENTION_MASK).long().sum(-1).cpu() - 1
    scores = per_token.gather(-1, last[:, None]).squeeze(-1)
    return batch.copy().set(out_key, scores.to(batch.device or "cpu"))


def _critic_pass(state, batch, fn_name: str, out_key, mb_spec, *, scores: bool) -> torch.Tensor:
    """A critic state's values (token aligned) or per-token scores, [B, T] on the CPU."""
    error, spec = None, None
    try:
        _check_out_key(out_key)
        spec = resolve_mb_spec(state, mb_spec) if isinstance(state, EngineState) else None
    except ConfigError as exc:
        error = exc
    prepare(state, batch, fn_name, critic=True)
    check_live(state, fn_name, local_error=error)
    same_on_every_rank(fn_name, {"out_key": out_key, "mb_spec": spec})
    B, T = batch.get(K.INPUT_IDS).shape
    out = torch.zeros(B, T, dtype=torch.float32)
    was_training = state.model.training
    state.model.eval()
    try:
        _scatter_outputs(state, batch, fn_name, spec, [None, out] if scores else [out, None])
    finally:
        state.model.train(was_training)
    return out
