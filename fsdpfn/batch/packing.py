"""Packing: the real tokens of a [B, T] batch's rows concatenated into one stream of N tokens.

``cu_seqlens`` marks where each sequence starts (the varlen / flash-attention convention); a
prediction made at token i is about token i+1 (next_token_targets, shift_to_token_aligned).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch
from tensordict import TensorDictBase

from fsdpfn import keys as K
from fsdpfn.batch.validate import check_prefix_mask, rows_tensor
from fsdpfn.errors import BatchError

__all__ = ["Packed", "pack", "unpack", "unpack_seqs", "apply_scatter", "seq_sum",
           "next_token_targets", "shift_to_token_aligned"]


@attrs.frozen(eq=False)
class Packed:
    """Rows `rows` of a [B, T] batch, packed without padding.

    N = total real tokens, S = number of sequences (= len(rows)). Sequence s is
    input_ids[cu_seqlens[s]:cu_seqlens[s+1]] and came from batch row rows[s].
    """

    input_ids: torch.Tensor      # int64 [N]
    position_ids: torch.Tensor   # int64 [N], 0..len-1 per sequence
    cu_seqlens: torch.Tensor     # int32 [S+1], cu_seqlens[0] = 0
    seq_lens: tuple[int, ...]    # [S]
    rows: torch.Tensor           # int64 [S], row of the original batch
    seq_ids: torch.Tensor        # int64 [N], sequence s of each token
    token_index: torch.Tensor    # int64 [N], rows[seq]*T + position: flat index into [B*T]
    max_seqlen: int
    T: int                       # padded width of the original batch
    B: int                       # rows of the original batch (not S)
    values: dict = attrs.field(factory=dict)  # key -> [N, ...] (token keys) or [S, ...] (row keys)

    def to(self, device) -> "Packed":
        """The same pack with every tensor on ``device``."""
        moved = {f.name: getattr(self, f.name).to(device) for f in attrs.fields(Packed)
                 if isinstance(getattr(self, f.name), torch.Tensor)}
        moved["values"] = {k: v.to(device) for k, v in self.values.items()}
        return attrs.evolve(self, **moved)

    @property
    def n_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def n_seqs(self) -> int:
        return len(self.seq_lens)


def pack(batch: TensorDictBase, keys: Sequence[str] = (), *, rows=None) -> Packed:
    """Pack rows `rows` (default: all, in order) of `batch` into one token stream.

    Each key in `keys` lands in `values`: a tensor whose first two dims are [B, T] is token
    aligned and packed to [N, ...]; any other tensor with first dim B is per row, giving [S, ...].
    rows=[] gives an empty Packed (N = S = 0), the empty micro-batch of plan_microbatches.
    """
    B = batch.batch_size[0]
    ids_full, attn_full = batch.get(K.INPUT_IDS), batch.get(K.ATTENTION_MASK)
    T = ids_full.shape[1]
    r = rows_tensor(range(B) if rows is None else rows, B, ids_full.device)
    attn = attn_full[r]                                   # (S, T)
    if attn.shape[0]:
        check_prefix_mask(attn)  # positions below assume right padding
    lens = attn.sum(dim=1)                                # (S,)
    seq_ids, position_ids = attn.nonzero(as_tuple=True)   # row-major = sequence order
    cu = torch.zeros(len(r) + 1, dtype=torch.int32, device=ids_full.device)
    cu[1:] = torch.cumsum(lens, 0)
    seq_lens = tuple(lens.tolist())
    values = {key: _pack_value(batch, key, r, attn, B, T) for key in keys}
    return Packed(input_ids=ids_full[r][attn], position_ids=position_ids, cu_seqlens=cu,
                  seq_lens=seq_lens, rows=r, seq_ids=seq_ids,
                  token_index=r[seq_ids] * T + position_ids,
                  max_seqlen=max(seq_lens, default=0), T=T, B=B, values=values)


def _pack_value(batch, key, r, attn, B, T) -> torch.Tensor:
    if key not in batch.keys():
        raise BatchError(f"batch is missing key {key!r} (needed for packing); keys present: "
                         f"{sorted(batch.keys())}")
    x = batch.get(key)
    if x.ndim >= 2 and tuple(x.shape[:2]) == (B, T):
        return x[r][attn]
    return x[r]


def unpack(packed: Packed, x: torch.Tensor, *, fill: float = 0.0, compact: bool = False):
    """x[N, ...] -> [B, T, ...] with `fill` on padding and on rows not in the pack.

    compact=True gives [S, T, ...] instead, row s being sequence s (rows[s] of the batch).
    Autograd flows through x.
    """
    rows = packed.n_seqs if compact else packed.B
    index = packed.seq_ids * packed.T + packed.position_ids if compact else packed.token_index
    out = x.new_full((rows * packed.T, *x.shape[1:]), fill)
    return out.index_put((index,), x).view(rows, packed.T, *x.shape[1:])


def apply_scatter(out: torch.Tensor, packed: Packed, x: torch.Tensor) -> None:
    """Write a micro-batch's packed x[N, ...] into the full out[B, T, ...] in place.

    Only the packed rows' real tokens are written; everything else in `out` is kept.
    """
    assert tuple(out.shape[:2]) == (packed.B, packed.T), (out.shape, packed.B, packed.T)
    out.view(packed.B * packed.T, *out.shape[2:])[packed.token_index] = x.to(out.dtype)


def unpack_seqs(packed: Packed, y: torch.Tensor, *, fill: float = 0.0) -> torch.Tensor:
    """Per-sequence y[S, ...] -> per-row [B, ...], `fill` on rows not in the pack."""
    out = y.new_full((packed.B, *y.shape[1:]), fill)
    return out.index_put((packed.rows,), y)


def seq_sum(packed: Packed, x: torch.Tensor) -> torch.Tensor:
    """Sum of x[N, ...] over each sequence -> [S, ...] (e.g. sequence log-probs for DPO)."""
    out = x.new_zeros((packed.n_seqs, *x.shape[1:]))
    return out.index_add(0, packed.seq_ids, x)


def next_token_targets(packed: Packed) -> tuple[torch.Tensor, torch.Tensor]:
    """(targets[N], valid[N]): targets[i] = input_ids[i+1] of the same sequence.

    valid is False at each sequence's last token, where targets holds 0 (a safe id to gather at;
    mask it out). A prediction made at i is for token i+1: see shift_to_token_aligned.
    """
    ids = packed.input_ids
    last = _first_or_last(packed, last=True)
    targets = torch.roll(ids, -1).masked_fill(last, 0)
    return targets, ~last


def shift_to_token_aligned(packed: Packed, x_pred: torch.Tensor) -> torch.Tensor:
    """Move x_pred[N, ...] (made at i, about token i+1) to position i+1; 0 at first tokens.

    The result is token aligned like the public logp: out[i] = x_pred[i-1] within a sequence,
    0 where position_ids == 0. Autograd flows through x_pred.
    """
    if x_pred.shape[0] == 0:
        return x_pred.clone()
    shifted = torch.cat([x_pred[:1].new_zeros(x_pred[:1].shape), x_pred[:-1]])
    first = _first_or_last(packed, last=False).view(-1, *([1] * (x_pred.ndim - 1)))
    return torch.where(first, shifted.new_zeros(()), shifted)


def _first_or_last(packed: Packed, *, last: bool) -> torch.Tensor:
    """bool [N]: True at each sequence's first (or last) token."""
    flag = torch.zeros(packed.n_tokens, dtype=torch.bool, device=packed.input_ids.device)
    if packed.n_tokens:
        starts = packed.cu_seqlens[1:] - 1 if last else packed.cu_seqlens[:-1]
        flag[starts.long()] = True
    return flag
