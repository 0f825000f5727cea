"""PackedModel: the root module fsdpfn shards. One packed row in, log-probs or values out.

It wraps an HF causal-LM (or token-classification critic) and runs the decoder stack on a packed
token stream [N] (sequences concatenated, position_ids restarting per sequence, attention never
crossing a boundary), then computes next-token log-probs straight from the last hidden states and the
lm_head weight in chunks (vocab-parallel under tp), so the [N, V] logits never exist. Doing the head
inside this module's forward keeps FSDP2's root hooks in charge of the lm_head and embedding shards
(all-gather before, reduce-scatter of their gradients after).

With context parallelism (``cp_group`` set), every cp rank is handed the same whole pack; the
decoder and the head run on this rank's 1/cp of it (fsdpfn.engine.cp.split_pack, Ulysses attention) and
the per-token results are all-gathered back to the whole pack (fsdpfn.engine.cp.gather_tokens).

Rotary embeddings whose frequencies follow the longest position they are handed (dynamic NTK,
longrope) rotate every micro-batch of a call with the highest position of the call's padded
batch (T - 1, over every data-parallel rank: ``batch_rope_top``, set by the engine's forward
and step functions), as the model's own forward on that padded batch does: a row's log-probs
then do not depend on how the batch is cut into micro-batches or spread over ranks. Under cp
a rank's 1/cp of the pack also sees that position (``_whole_pack_rope``): on its own it would
rotate its positions as a shorter sequence. A dynamic-NTK rotary is reset to its original
frequencies each call (``_forget_growth``), as a freshly loaded model's would be.

State-dict keys carry the prefix ``lm.`` (the HF model); export strips it.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
from torch import nn

from fsdpfn.engine import cp
from fsdpfn.engine.attention import packed_attention_mask, packed_keywords, varlen_available
from fsdpfn.ops import vocab_parallel_logprobs
from fsdpfn.ops.logprobs import head_logprobs, liger_logprobs, vocab_shard_range

__all__ = ["PackedModel"]

# the highest position ([1, 1]) the length-dependent rotaries see, while a pack runs
_PACK_TOP: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar(
    "fsdpfn_pack_top_position", default=None)
# the highest position of the call's whole batch (every dp rank's rows), while a call runs
_BATCH_TOP: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "fsdpfn_batch_top_position", default=None)


def length_dependent_rotaries(module: nn.Module) -> list[nn.Module]:
    """The rotary embeddings under ``module`` whose frequencies depend on the highest position
    of the call (transformers' ``dynamic`` NTK and ``longrope`` types, one type or one per
    layer type)."""
    return [sub for sub in module.modules()
            if any("dynamic" in k or k == "longrope" for k in _rope_kinds(sub))]


def _rope_kinds(module: nn.Module) -> list[str]:
    """A module's rotary types (transformers' ``rope_type``: one, or one per layer type)."""
    kind = getattr(module, "rope_type", None)
    return [k for k in (kind.values() if isinstance(kind, dict) else (kind,))
            if isinstance(k, str)]


def _position_arg(args, kwargs):
    return ("kw", kwargs["position_ids"]) if "position_ids" in kwargs else ("arg", args[1])


def _forget_growth(module) -> None:
    """A dynamic-NTK rotary back to its original frequencies: transformers keeps the longest
    length a module has seen and rotates every later, shorter call with it, so a call's numbers
    would depend on the calls before it. Reset first, each call rotates as a freshly loaded
    model's forward on its batch does."""
    for name in [n for n, _ in module.named_buffers(recurse=False)] + list(vars(module)):
        if not name.endswith("original_inv_freq") or not torch.is_tensor(getattr(module, name)):
            continue
        prefix = name[:-len("original_inv_freq")]
        if not hasattr(module, f"{prefix}inv_freq") or not hasattr(module, "original_max_seq_len"):
            continue
        original = getattr(module, name)
        module.register_buffer(f"{prefix}inv_freq", original.to(getattr(
            module, f"{prefix}inv_freq").device), persistent=False)
        setattr(module, f"{prefix}max_seq_len_cached", module.original_max_seq_len)


def _append_top(module, args, kwargs):
    """Forward pre-hook: the pack's highest position appended to the call's positions, so that
    the frequency update sees it (the extra entry's cos/sin are dropped by _drop_top)."""
    top = _PACK_TOP.get()
    if top is None:
        return None
    if any("dynamic" in k for k in _rope_kinds(module)):
        _forget_growth(module)
    where, pos = _position_arg(args, kwargs)
    pos = torch.cat((pos, top.to(pos.device, pos.dtype).expand(pos.shape[0], 1)), dim=1)
    if where == "kw":
        return args, {**kwargs, "position_ids": pos}
    return (args[0], pos, *args[2:]), kwargs


def _drop_top(module, args, kwargs, output):
    """Forward hook: the appended position's entry removed from every output (cos, sin)."""
    if _PACK_TOP.get() is None:
        return None
    return tuple(t[:, :-1] for t in output)


@contextlib.contextmanager
def batch_rope_top(top: int | None):
    """While a call runs: ``top``, the highest position of its whole batch, is what every pack's
    length-dependent rotaries rotate with (None: each pack's own)."""
    token = _BATCH_TOP.set(top)
    try:
        yield
    finally:
        _BATCH_TOP.reset(token)


@contextlib.contextmanager
def _whole_pack_rope(position_ids: torch.Tensor):
    """While a pack (or a cp rank's part of it) runs: length-dependent rotaries rotate with the
    whole pack's highest position, or the call's batch's when higher, as the model's own forward
    on the padded batch would."""
    top = position_ids.max().reshape(1, 1)
    batch_top = _BATCH_TOP.get()
    if batch_top is not None:
        top = top.clamp_min(batch_top)
    token = _PACK_TOP.set(top)
    try:
        yield
    finally:
        _PACK_TOP.reset(token)


class PackedModel(nn.Module):
    def __init__(self, lm: nn.Module, *, is_critic: bool):
        super().__init__()
        self.lm = lm
        self.is_critic = is_critic
        self.tp_group = None  # set by shard_model when the lm_head is split over the vocabulary
        self.cp_group = None  # set by shard_model under context parallelism (cp > 1)
        self.compute_dtype = torch.bfloat16  # set by shard_model: picks the attention path
        self.use_varlen = True  # False: the masked SDPA path even on CUDA (attn_impl="sdpa")
        self.logprobs_impl = "chunked"  # or "liger" (set by shard_model, checked there)
        rotaries = length_dependent_rotaries(lm)
        for rotary in rotaries:  # no-ops outside _whole_pack_rope
            rotary.register_forward_pre_hook(_append_top, with_kwargs=True)
            rotary.register_forward_hook(_drop_top, with_kwargs=True)
        # the engine's calls then find their batch's longest row first (runner.rope_top)
        self.length_dependent_rope = bool(rotaries)

    @property
    def base(self) -> nn.Module:
        """The decoder stack (whatever the family names it: model, gpt_neox, transformer)."""
        return self.lm.base_model

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                cu_seqlens: torch.Tensor, max_seqlen: int, targets: torch.Tensor | None = None,
                *, temperature: float = 1.0, with_entropy: bool = False,
                chunk_size: int = 1024, full_logits: bool = False):
        """input_ids, position_ids, targets [N]; cu_seqlens int32 [S+1].

        Actor: returns (logp[N], entropy[N] or None), the prediction made at token i for
        targets[i] (token i+1). Critic: returns values[N] float32. ``full_logits=True`` returns
        the whole [N, V] logits instead (for tests and debugging only: it is what the chunked
        head exists to avoid).
        """
        n = input_ids.shape[0]
        use_varlen = self.use_varlen and varlen_available(input_ids.device, self.compute_dtype)
        cu = cu_seqlens.to(input_ids.device, torch.int32)
        extra, rope = {}, contextlib.nullcontext()
        if self.cp_group is not None or (self.length_dependent_rope
                                         and _BATCH_TOP.get() is not None):
            rope = _whole_pack_rope(position_ids)
        if self.cp_group is not None:  # this rank's 1/cp of the pack; targets shifted before
            part = cp.split_pack(input_ids, position_ids, cu, max_seqlen, targets,
                                 cp=self.cp_group.size(), rank=self.cp_group.rank())
            input_ids, position_ids, targets = part.input_ids, part.position_ids, part.targets
            cu, max_seqlen, extra = part.cu_seqlens, part.max_seqlen, {
                "fsdpfn_cp_group": self.cp_group}
        keywords = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max_seqlen,
                        max_length_k=max_seqlen, fsdpfn_varlen=use_varlen, **extra)
        # handed down as keywords, and readable by the attention where a family's model or
        # layers do not pass them on (fsdpfn.engine.attention.packed_keywords)
        with packed_keywords(keywords), rope:
            out = self.base(
                input_ids=input_ids[None], position_ids=position_ids[None],
                attention_mask=packed_attention_mask(cu, n, input_ids.device,
                                                     use_varlen=use_varlen),
                use_cache=False, **keywords)
        results = self._head(out.last_hidden_state[0], targets, temperature=temperature,
                             with_entropy=with_entropy, chunk_size=chunk_size,
                             full_logits=full_logits)
        if self.cp_group is None:
            return results
        if isinstance(results, tuple):
            return tuple(None if x is None else cp.gather_tokens(x, self.cp_group, n)
                         for x in results)
        return cp.gather_tokens(results, self.cp_group, n)

    def _head(self, hidden: torch.Tensor, targets, *, temperature: float, with_entropy: bool,
              chunk_size: int, full_logits: bool):
        """hidden [N, H] -> values[N] (critic), logits [N, V], or (logp[N], entropy[N] or None)."""
        if self.is_critic:
            # a fresh tensor, not a view: FSDP2 hooks the module's outputs for backward
            return self.lm.score(hidden).float().flatten().clone()
        head = self.lm.get_output_embeddings()
        softcap = getattr(self.lm.config, "final_logit_softcapping", None) or None
        if full_logits:
            logits = head(hidden)
            logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
            return logits if softcap is None else torch.tanh(logits / softcap) * softcap
        weight = head.weight  # (V, H), DTensor Shard(0) under tp
        bias = getattr(head, "bias", None)  # (V,) or None, sharded like the weight
        if self.tp_group is not None:
            local = weight.to_local()
            # uneven vocabularies: Shard(0) splits like torch.chunk (the last shards are shorter)
            start, stop = vocab_shard_range(weight.shape[0], self.tp_group.size(),
                                            torch.distributed.get_rank(self.tp_group))
            assert local.shape[0] == stop - start, (tuple(local.shape), start, stop)
            logp, entropy = vocab_parallel_logprobs(
                hidden, local, targets, group=self.tp_group, vocab_start=start,
                chunk_size=chunk_size, temperature=temperature, with_entropy=with_entropy,
                bias=None if bias is None else bias.to_local(), softcap=softcap)
        elif self.logprobs_impl == "liger" and not with_entropy and bias is None \
                and softcap is None:
            logp, entropy = liger_logprobs(hidden, weight, targets, temperature=temperature), None
        else:
            logp, entropy = head_logprobs(hidden, weight, targets, chunk_size=chunk_size,
                                          temperature=temperature, with_entropy=with_entropy,
                                          bias=bias, softcap=softcap)
        # fresh tensors, not views: FSDP2 hooks the module's outputs for backward
        return logp.clone(), (None if entropy is None else entropy.clone())
