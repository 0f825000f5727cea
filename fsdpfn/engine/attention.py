"""Packed-sequence attention for HF models: sequences concatenated into one row, no padding.

fsdpfn feeds models a single packed row [1, N] with position_ids restarting per sequence. Attention
must never cross a sequence boundary:
- CUDA: torch's variable-length flash attention (``torch.nn.attention.varlen``) over cu_seqlens.
- elsewhere: causal SDPA on each sequence's slice of the row (memory grows with the sum of
  squared sequence lengths, never with N^2); a 4D mask, when a caller hands one, is honoured.
Both honour what HF hands an attention function: ``scaling``, the layer's ``sliding_window`` and
``softcap`` (attention logit softcapping, computed like HF's eager attention). A layer the flash
path cannot compute exactly (a softcap; a window on a torch without ``window_size``) takes the
per-sequence path instead, said once in the log.
With context parallelism (cp > 1) the model's attention is ``fsdpfn_ulysses`` instead (fsdpfn.engine.cp:
all-to-all to whole sequences and 1/cp of the heads, this attention, and back).
The function is registered under the name ``fsdpfn_packed`` in transformers' AttentionInterface; the
model's ``config._attn_implementation`` is set to it by shard_model. The mask construction of HF is
bypassed by handing the model a ready 4D mask (see ``packed_attention_mask``).

The pack's boundaries reach the function as keywords (``cu_seq_lens_q`` ...) that the model hands
each decoder layer and the layer hands its attention. Some families do not pass them on (StableLM's
and Nemotron's layers, Falcon's model): PackedModel runs the stack inside ``packed_keywords``, and
the function takes the keywords it was not given from there; activation checkpointing's
recomputation in the backward sees the same ones (``recompute_context``).
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import logging

import torch
import torch.nn.functional as F

__all__ = ["ATTN_NAME", "register", "packed_attention_mask", "packed_attention", "varlen_honours",
           "packed_keywords", "pack_keywords", "recompute_context"]

ATTN_NAME = "fsdpfn_packed"
log = logging.getLogger("fsdpfn")

try:  # torch >= 2.10
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
    _VARLEN_PARAMS = set(inspect.signature(_varlen_attn).parameters)
except ImportError:  # pragma: no cover - older torch
    _varlen_attn, _VARLEN_PARAMS = None, set()


def block_causal_mask(cu_seqlens: torch.Tensor, n: int, device) -> torch.Tensor:
    """bool [1, 1, N, N]: token i attends to j iff same sequence and j <= i."""
    seq_id = torch.repeat_interleave(
        torch.arange(len(cu_seqlens) - 1, device=device),
        (cu_seqlens[1:] - cu_seqlens[:-1]).to(device).long(), output_size=n)
    idx = torch.arange(n, device=device)
    mask = (seq_id[:, None] == seq_id[None, :]) & (idx[None, :] <= idx[:, None])
    return mask[None, None]


def packed_attention_mask(cu_seqlens: torch.Tensor, n: int, device, *,
                          use_varlen: bool) -> torch.Tensor | None:
    """What is handed to an HF model as ``attention_mask``: None (the registered mask function
    returns None too); the attention reads cu_seqlens, on the varlen path and on the
    per-sequence SDPA path alike. ``block_causal_mask`` is the equivalent dense mask."""
    return None


def varlen_available(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Flash varlen attention: CUDA and a half dtype (float32 takes the masked SDPA path)."""
    return (_varlen_attn is not None and device.type == "cuda"
            and dtype in (torch.bfloat16, torch.float16))


def _window_arg(sliding_window) -> int | None:
    """HF's ``sliding_window`` W: token i attends to j iff i - W < j <= i (None: no window)."""
    return int(sliding_window) if sliding_window else None


def varlen_honours(sliding_window, softcap) -> bool:
    """Whether torch's flash varlen attention computes this layer exactly: no logit softcap
    (flash has none) and a window only where torch exposes ``window_size``."""
    if softcap:
        return False
    return _window_arg(sliding_window) is None or (
        "window_size" in _VARLEN_PARAMS and "is_causal" not in _VARLEN_PARAMS)


def _varlen(query, key, value, cu_seqlens, max_seqlen, scaling, window):
    # query [1, Hq, N, D] -> [N, Hq, D]
    q = query[0].transpose(0, 1)
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    kwargs = {"scale": scaling}
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in _VARLEN_PARAMS:
            kwargs["enable_gqa"] = True
        else:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    if "is_causal" in _VARLEN_PARAMS:
        kwargs["is_causal"] = True
    else:  # flash's left window counts the keys before the query: W - 1 of them
        kwargs["window_size"] = (-1 if window is None else window - 1, 0)
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    out = _varlen_attn(q, k, v, cu, cu, max_seqlen, max_seqlen, **kwargs)
    return out[None]  # [1, N, Hq, D]


_FALLBACK_LOGGED: set = set()


def _log_fallback(module, window, softcap) -> None:
    """One log line per (layer class, reason): this layer leaves the flash path."""
    key = (type(module).__name__, bool(window), bool(softcap))
    if key not in _FALLBACK_LOGGED:
        _FALLBACK_LOGGED.add(key)
        why = "attention logit softcapping" if softcap else "a sliding window"
        log.info("%s: %s that torch's flash varlen attention does not compute here; this layer "
                 "runs the exact per-sequence attention instead", key[0], why)


# the packed keywords of the running PackedModel call (fsdpfn.engine.packed)
_PACK_KEYWORDS: contextvars.ContextVar[dict] = contextvars.ContextVar("fsdpfn_pack_keywords",
                                                                      default={})


@contextlib.contextmanager
def packed_keywords(keywords: dict):
    """While the decoder stack runs on a pack, the pack's keywords (``cu_seq_lens_q`` ...) are
    what ``pack_keywords`` fills in, in this thread."""
    token = _PACK_KEYWORDS.set(keywords)
    try:
        yield
    finally:
        _PACK_KEYWORDS.reset(token)


def recompute_context():
    """``context_fn`` of activation checkpointing (torch.utils.checkpoint, non-reentrant): the
    recomputation of a layer in the backward, outside ``packed_keywords``, sees the keywords its
    forward saw."""
    return contextlib.nullcontext(), packed_keywords(_PACK_KEYWORDS.get())


def pack_keywords(kwargs: dict) -> dict:
    """``kwargs`` with the packed keywords it lacks taken from the running pack's."""
    kept = _PACK_KEYWORDS.get()
    missing = {k: v for k, v in kept.items() if k not in kwargs}
    return {**missing, **kwargs} if missing else kwargs


def packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     sliding_window=None, softcap=None, **kwargs):
    """HF attention-interface function; query [1, Hq, N, D] -> ([1, N, Hq, D], None).

    Honours what HF hands every attention function: ``scaling`` (e.g. Gemma's
    query_pre_attn_scalar), ``sliding_window`` (this layer's window, None on global layers) and
    ``softcap`` (tanh softcapping of the attention logits)."""
    kwargs = pack_keywords(kwargs)
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    allowed = kwargs.get("fsdpfn_varlen", True)  # False: attn_impl="sdpa" asked for SDPA
    window, softcap = _window_arg(sliding_window), (float(softcap) if softcap else None)
    if attention_mask is None and cu_seqlens is not None and allowed and \
            varlen_available(query.device, query.dtype):
        if varlen_honours(window, softcap):
            return _varlen(query, key, value, cu_seqlens, int(kwargs["max_length_q"]), scaling,
                           window), None
        _log_fallback(module, window, softcap)
    if attention_mask is None and cu_seqlens is None:
        raise RuntimeError("fsdpfn_packed attention needs cu_seq_lens_q (the packed "
                           "sequences' boundaries): called outside a PackedModel's pack")
    if key.shape[1] != query.shape[1]:
        rep = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    if attention_mask is None:
        out = _per_sequence(query, key, value, cu_seqlens, scaling, dropout, window, softcap)
    else:
        if window is not None or softcap is not None:
            raise RuntimeError("fsdpfn_packed attention: a dense mask with a sliding window or "
                               "softcap is not supported; pass cu_seq_lens_q")
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                             dropout_p=dropout, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _window_mask(n: int, window: int, device) -> torch.Tensor:
    """bool [n, n]: causal, and i - window < j."""
    i = torch.arange(n, device=device)
    diff = i[:, None] - i[None, :]
    return (diff >= 0) & (diff < window)


def _softcapped(q, k, v, scaling, dropout, window, softcap) -> torch.Tensor:
    """HF's eager attention with tanh logit softcapping, for one sequence [1, H, n, D]."""
    n = q.shape[2]
    scale = q.shape[-1] ** -0.5 if scaling is None else scaling
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    allowed = _window_mask(n, window if window is not None else n, q.device)
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    probs = F.dropout(probs, p=dropout, training=dropout > 0)
    return torch.matmul(probs, v)


def _one_sequence(q, k, v, scaling, dropout, window, softcap) -> torch.Tensor:
    if softcap is not None:
        return _softcapped(q, k, v, scaling, dropout, window, softcap)
    if window is not None and window < q.shape[2]:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=_window_mask(q.shape[2], window,
                                                                              q.device),
                                              dropout_p=dropout, scale=scaling)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout,
                                          scale=scaling)


def _per_sequence(query, key, value, cu_seqlens, scaling, dropout, window=None,
                  softcap=None) -> torch.Tensor:
    """Causal attention on each sequence of the packed row; [1, H, N, D] in and out."""
    bounds = [int(b) for b in cu_seqlens.tolist()]
    n = query.shape[2]
    parts = [_one_sequence(query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], scaling, dropout,
                           window, softcap)
             for s, e in zip(bounds[:-1], bounds[1:]) if e > s]
    if bounds[-1] < n:  # tokens after the last sequence (none from fsdpfn's packing)
        parts.append(query.new_zeros(*query.shape[:2], n - bounds[-1], value.shape[-1]))
    return torch.cat(parts, dim=2) if parts else query.new_zeros(*query.shape[:3],
                                                                 value.shape[-1])


def register() -> None:
    """Register ``fsdpfn_packed`` with transformers (idempotent); fsdpfn.engine.cp registers the
    context-parallel ``fsdpfn_ulysses`` built on it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    # outside any compiled graph (EngineConfig.compile): the flash call takes the packed
    # lengths as host integers, and the per-sequence path reads the boundaries on the host
    AttentionInterface.register(ATTN_NAME, torch.compiler.disable(packed_attention))
    # mask creation is bypassed (a ready mapping is passed), but HF validates the name
    AttentionMaskInterface.register(ATTN_NAME, lambda *args, **kwargs: None)
