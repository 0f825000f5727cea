"""Packed-sequence attention for HF models: sequences concatenated into one row, no padding.

fsdpfn feeds models a single packed row [1, N] with position_ids restarting per sequence. Attention
must never cross a sequence boundary:
- CUDA: torch's variable-length flash attention (``torch.nn.attention.varlen``) over cu_seqlens.
- elsewhere: causal SDPA on each sequence's slice of the row (memory grows with the sum of
  squared sequence lengths, never with N^2); a 4D mask, when a caller hands one, is honoured.
With context parallelism (cp > 1) the model's attention is ``fsdpfn_ulysses`` instead (fsdpfn.cp:
all-to-all to whole sequences and 1/cp of the heads, this attention, and back).
The function is registered under the name ``fsdpfn_packed`` in transformers' AttentionInterface; the
model's ``config._attn_implementation`` is set to it by shard_model. The mask construction of HF is
bypassed by handing the model a ready 4D mask (see ``packed_attention_mask``).
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

__all__ = ["ATTN_NAME", "register", "packed_attention_mask", "packed_attention"]

ATTN_NAME = "fsdpfn_packed"

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


def _varlen(query, key, value, cu_seqlens, max_seqlen, scaling):
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
    else:
        kwargs["window_size"] = (-1, 0)
    cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
    out = _varlen_attn(q, k, v, cu, cu, max_seqlen, max_seqlen, **kwargs)
    return out[None]  # [1, N, Hq, D]


def packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     **kwargs):
    """HF attention-interface function; query [1, Hq, N, D] -> ([1, N, Hq, D], None)."""
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    allowed = kwargs.get("fsdpfn_varlen", True)  # False: attn_impl="sdpa" asked for SDPA
    if attention_mask is None and cu_seqlens is not None and allowed and \
            varlen_available(query.device, query.dtype):
        return _varlen(query, key, value, cu_seqlens, int(kwargs["max_length_q"]), scaling), None
    if attention_mask is None and cu_seqlens is None:
        raise RuntimeError("fsdpfn_packed attention needs a mask or cu_seq_lens_q")
    if key.shape[1] != query.shape[1]:
        rep = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
    if attention_mask is None:
        out = _per_sequence(query, key, value, cu_seqlens, scaling, dropout)
    else:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                             dropout_p=dropout, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _per_sequence(query, key, value, cu_seqlens, scaling, dropout) -> torch.Tensor:
    """Causal SDPA on each sequence of the packed row; [1, H, N, D] in and out."""
    bounds = [int(b) for b in cu_seqlens.tolist()]
    n = query.shape[2]
    parts = [F.scaled_dot_product_attention(query[:, :, s:e], key[:, :, s:e], value[:, :, s:e],
                                            is_causal=True, dropout_p=dropout, scale=scaling)
             for s, e in zip(bounds[:-1], bounds[1:]) if e > s]
    if bounds[-1] < n:  # tokens after the last sequence (none from fsdpfn's packing)
        parts.append(query.new_zeros(*query.shape[:2], n - bounds[-1], value.shape[-1]))
    return torch.cat(parts, dim=2) if parts else query.new_zeros(*query.shape[:3],
                                                                 value.shape[-1])


def register() -> None:
    """Register ``fsdpfn_packed`` with transformers (idempotent); fsdpfn.cp registers the
    context-parallel ``fsdpfn_ulysses`` built on it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_NAME, packed_attention)
    # mask creation is bypassed (a ready mapping is passed), but HF validates the name
    AttentionMaskInterface.register(ATTN_NAME, lambda *args, **kwargs: None)
