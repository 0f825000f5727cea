"""Context parallelism (Ulysses sequence parallel): each cp rank holds 1/cp of a packed micro-batch.

Every rank of a cp group is handed the same packed micro-batch: input_ids[N], position_ids[N],
the cu_seqlens of the whole pack and the next-token targets[N] (shifted *before* the split, so a
target living on the next cp rank is never lost). ``split_pack`` pads the pack to a multiple of cp
(at most cp-1 tokens, a sequence of their own that no real token attends to) and keeps this rank's
contiguous slice of n = N_pad / cp tokens. The decoder runs on that slice: embeddings, norms, MLPs
and rotary embeddings are token-wise; attention is the one place that needs the whole sequence:

    q, k, v  [1, H, n, D]   (this rank's tokens, every head of this tp rank)
      -- all-to-all (seq_to_heads) -->   [1, H/cp, N_pad, D]   (every token, 1/cp of the heads)
      packed causal attention over the whole pack's cu_seqlens
      -- all-to-all (heads_to_seq) -->   [1, n, H, D]

kv heads that cp does not divide (GQA with fewer kv heads than cp) are replicated first, as few
times as needed (``replicate_kv``). Under tp the heads are split by tp, then by cp. The head runs on
this rank's tokens; ``gather_tokens`` then all-gathers the per-token results over cp, so every cp
rank sees the whole micro-batch (the loss function is unchanged). Its backward keeps this rank's
slice of the gradient: every cp rank computes the same loss, so each token's gradient enters once,
on the rank holding it, and FSDP sums parameter gradients over dp x cp.

The attention is selected per model through transformers' attention registry under
``ULYSSES_NAME``; the cp process group travels with each call (keyword ``fsdpfn_cp_group``), never
through a global.
"""

from __future__ import annotations

import attrs
import torch
import torch.distributed as dist

from fsdpfn.engine.attention import ATTN_NAME, pack_keywords, packed_attention

__all__ = ["ULYSSES_NAME", "CPSlice", "padded_len", "split_pack", "gather_tokens", "seq_to_heads",
           "heads_to_seq", "replicate_kv", "ulysses_attention", "register", "attn_name"]

ULYSSES_NAME = "fsdpfn_ulysses"


def padded_len(n_tokens: int, cp: int) -> int:
    """The pack's length rounded up to a multiple of cp (the padding is at most cp - 1 tokens)."""
    return -(-n_tokens // cp) * cp


# ---------------------------------------------------------------- splitting the pack


@attrs.frozen(eq=False)
class CPSlice:
    """This cp rank's part of a packed micro-batch of ``n_tokens`` real tokens."""

    input_ids: torch.Tensor      # int64 [n]
    position_ids: torch.Tensor   # int64 [n]
    targets: torch.Tensor | None  # int64 [n]
    cu_seqlens: torch.Tensor     # int32 [S+1 or S+2]: the whole padded pack (padding: its own seq)
    max_seqlen: int
    n_tokens: int                # real tokens of the whole pack (N)


def split_pack(input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor,
               max_seqlen: int, targets: torch.Tensor | None, *, cp: int, rank: int) -> CPSlice:
    """Pad the pack [N] to a multiple of cp and keep rank ``rank``'s contiguous slice."""
    n = input_ids.shape[0]
    total = padded_len(n, cp)
    pad = total - n
    cu = cu_seqlens.to(input_ids.device, torch.int32)
    if pad:  # padding tokens form a sequence of their own: no real token attends to them
        cu = torch.cat([cu, cu.new_tensor([total])])
        input_ids = torch.cat([input_ids, input_ids.new_zeros(pad)])
        position_ids = torch.cat([position_ids, torch.arange(pad, dtype=position_ids.dtype,
                                                             device=position_ids.device)])
        if targets is not None:
            targets = torch.cat([targets, targets.new_zeros(pad)])
    local = slice(rank * (total // cp), (rank + 1) * (total // cp))
    return CPSlice(input_ids=input_ids[local], position_ids=position_ids[local],
                   targets=None if targets is None else targets[local], cu_seqlens=cu,
                   max_seqlen=max(int(max_seqlen), pad), n_tokens=n)


class _GatherTokens(torch.autograd.Function):
    """all-gather of x[n, ...] over cp -> the first n_tokens of [cp * n, ...]; backward keeps this
    rank's slice (every cp rank computes the same loss from the gathered tensor, so summing
    the slices over ranks would count it cp times)."""

    @staticmethod
    def forward(ctx, x, group, n_tokens):
        ctx.rank, ctx.n = dist.get_rank(group), x.shape[0]
        x = x.contiguous()
        parts = [torch.empty(x.shape, dtype=x.dtype, device=x.device)
                 for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts)[:n_tokens].clone()  # a fresh tensor: FSDP hooks the outputs

    @staticmethod
    def backward(ctx, grad):
        start, stop = ctx.rank * ctx.n, (ctx.rank + 1) * ctx.n
        local = grad.new_zeros((ctx.n, *grad.shape[1:]))  # padding tokens get no gradient
        real = grad[start:min(stop, grad.shape[0])]
        local[:real.shape[0]] = real
        return local, None, None


def gather_tokens(x: torch.Tensor, group, n_tokens: int) -> torch.Tensor:
    """This rank's per-token results x[n, ...] -> the whole pack's [N, ...] (padding dropped)."""
    return _GatherTokens.apply(x, group, n_tokens)


# ---------------------------------------------------------------- all-to-all, with autograd


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """x[cp, ...]: chunk j goes to rank j; the result's chunk i came from rank i."""
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # contiguous, whatever x was
    dist.all_to_all_single(out, x, group=group)
    return out


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_heads_fwd(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq_fwd(grad, ctx.group), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _heads_to_seq_fwd(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads_fwd(grad, ctx.group), None


def _seq_to_heads_fwd(x: torch.Tensor, group) -> torch.Tensor:
    """[1, H, n, D] (tokens of this rank) -> [1, H/cp, cp*n, D] (every token, heads of this rank)."""
    cp = dist.get_world_size(group)
    _, H, n, D = x.shape
    got = _all_to_all(x.reshape(cp, H // cp, n, D), group)    # [cp (source rank), H/cp, n, D]
    return got.transpose(0, 1).reshape(1, H // cp, cp * n, D)


def _heads_to_seq_fwd(x: torch.Tensor, group) -> torch.Tensor:
    """[1, H/cp, cp*n, D] -> [1, H, n, D]: the inverse of _seq_to_heads_fwd."""
    cp = dist.get_world_size(group)
    _, h, total, D = x.shape
    n = total // cp
    send = x.reshape(h, cp, n, D).transpose(0, 1)              # [cp (target rank), h, n, D]
    got = _all_to_all(send, group)                            # [cp (source rank: head group), h, n, D]
    return got.reshape(1, cp * h, n, D)


def seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """[1, H, n, D] -> [1, H/cp, cp*n, D] over the cp group (autograd: the inverse all-to-all)."""
    return _SeqToHeads.apply(x, group)


def heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """[1, H/cp, cp*n, D] -> [1, H, n, D] over the cp group (autograd: the inverse all-to-all)."""
    return _HeadsToSeq.apply(x, group)


def replicate_kv(key: torch.Tensor, value: torch.Tensor, n_q_heads: int, cp: int):
    """Repeat each kv head r times, r the smallest divisor of the GQA ratio with cp | Hkv * r.

    Query head i reads kv head i // (Hq / Hkv) before and i // (Hq / (Hkv * r)) after: the same
    head. Its gradient sums over the copies (repeat_interleave's backward)."""
    n_kv = key.shape[1]
    if n_kv % cp == 0:
        return key, value
    ratio = n_q_heads // n_kv
    rep = next(r for r in range(1, ratio + 1) if ratio % r == 0 and (n_kv * r) % cp == 0)
    return key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)


# ---------------------------------------------------------------- the attention function


def ulysses_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                      **kwargs):
    """HF attention-interface function: query [1, Hq, n, D] of this cp rank's tokens ->
    ([1, n, Hq, D], None). Needs ``fsdpfn_cp_group`` and the whole pack's ``cu_seq_lens_q``."""
    kwargs = pack_keywords(kwargs)  # a dict of this call's own: popped below
    group = kwargs.pop("fsdpfn_cp_group", None)
    if group is None:
        raise RuntimeError(f"{ULYSSES_NAME} attention needs the keyword fsdpfn_cp_group (the cp "
                           "process group); the model is called by fsdpfn's PackedModel")
    if attention_mask is not None:
        raise RuntimeError(f"{ULYSSES_NAME} attention reads cu_seq_lens_q, got a dense mask")
    cp = dist.get_world_size(group)
    key, value = replicate_kv(key, value, query.shape[1], cp)
    q, k, v = (seq_to_heads(x, group) for x in (query, key, value))
    out, _ = packed_attention(module, q, k, v, None, scaling=scaling, dropout=dropout, **kwargs)
    # out [1, N_pad, Hq/cp, D] -> [1, Hq/cp, N_pad, D] -> [1, Hq, n, D] -> [1, n, Hq, D]
    back = heads_to_seq(out.transpose(1, 2), group)
    return back.transpose(1, 2).contiguous(), None


def attn_name(cp: int) -> str:
    """The registered attention a model sharded with context parallelism ``cp`` uses."""
    return ATTN_NAME if cp == 1 else ULYSSES_NAME


def register() -> None:
    """Register ``fsdpfn_ulysses`` (and the packed attention it wraps) with transformers
    (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from fsdpfn.engine import attention
    attention.register()
    # outside any compiled graph (EngineConfig.compile), like the attention it wraps
    AttentionInterface.register(ULYSSES_NAME, torch.compiler.disable(ulysses_attention))
    AttentionMaskInterface.register(ULYSSES_NAME, lambda *args, **kwargs: None)
