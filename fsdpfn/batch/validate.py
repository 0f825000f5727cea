"""Validation of the public batch layout (docs/api.md "Batch layout") and row selection.

validate_batch runs once, at the public entry point; every check is vectorized and names the key,
the rule and the value received.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from tensordict import TensorDictBase

from fsdpfn import keys as K
from fsdpfn.errors import BatchError, ConfigError

__all__ = ["validate_batch", "row_lengths", "select_rows"]


def validate_batch(batch, *, require: Sequence[str] = (), vocab_size: int | None = None,
                   group_size: int | None = None, pairs: bool = False,
                   why: Mapping[str, str] | None = None, nonempty: bool | None = None) -> None:
    """Raise BatchError unless `batch` follows the public layout; never mutates it.

    input_ids and attention_mask are always required; `require` adds keys (e.g. loss_mask,
    ref_logp) and `why[key]` says what needs them, for the message. Checks, in order:
    batch_size [B] with B >= 1; input_ids int64 [B, T]; attention_mask bool [B, T], a contiguous
    prefix with at least one True per row; token ids in [0, vocab_size) on real tokens (>= 0
    when vocab_size is None); loss_mask bool [B, T], False at t=0, implies attention_mask, and
    (only when loss_mask is in `require`, or `nonempty` says so) at least one True in the batch
    (a data-parallel rank's part may have none: the caller then checks the global batch with
    `nonempty=False` here and fsdpfn.agree.require_loss_tokens); every key of
    keys.TOKEN_FLOAT_KEYS present is float32 [B, T] and finite on real tokens; rewards float32 [B]
    finite; group_id and row_index int64 [B]; B divisible by group_size; B even when `pairs`
    (row 2i chosen, 2i+1 rejected), and with row_index (shard_batch's) each pair one pair of
    the global batch. Group membership is checked by check_groups.
    Padding positions are not inspected. All checks are vectorized.
    """
    B = _check_container(batch)
    _check_required(batch, (K.INPUT_IDS, K.ATTENTION_MASK, *require), why or {})
    ids, attn = batch.get(K.INPUT_IDS), batch.get(K.ATTENTION_MASK)
    _check_tensor(K.INPUT_IDS, ids, torch.int64, None, B)
    T = ids.shape[1]
    _check_tensor(K.ATTENTION_MASK, attn, torch.bool, (B, T), B)
    check_prefix_mask(attn)
    _check_token_ids(ids, attn, vocab_size)
    if K.LOSS_MASK in batch.keys():
        _check_loss_mask(batch.get(K.LOSS_MASK), attn, (B, T), B,
                         nonempty=K.LOSS_MASK in require if nonempty is None else nonempty)
    for key in K.TOKEN_FLOAT_KEYS:
        if key in batch.keys():
            x = batch.get(key)
            _check_tensor(key, x, torch.float32, (B, T), B)
            _check_finite(key, x, attn)
    if K.REWARDS in batch.keys():
        r = batch.get(K.REWARDS)
        _check_tensor(K.REWARDS, r, torch.float32, (B,), B)
        _check_finite(K.REWARDS, r, None)
    for key in (K.GROUP_ID, K.ROW_INDEX):
        if key in batch.keys():
            _check_tensor(key, batch.get(key), torch.int64, (B,), B)
    check_rows(B, group_size, pairs)
    if pairs and K.ROW_INDEX in batch.keys():
        _check_pairs_whole(batch.get(K.ROW_INDEX))


def _check_pairs_whole(row_index: torch.Tensor) -> None:
    """Rows 2k, 2k+1 of a pair batch that shard_batch made must be one pair of the global batch,
    global rows (2j, 2j+1): else its sharding moved single rows and split the pairs."""
    rows = row_index.view(-1, 2)
    bad = (rows[:, 0] % 2 != 0) | (rows[:, 1] != rows[:, 0] + 1)
    if bool(bad.any()):
        k = int(bad.nonzero()[0])
        raise BatchError(f"{K.ROW_INDEX}: pair {k} (rows {2 * k}, {2 * k + 1} of this batch) must "
                         f"be one pair of the global batch, global rows (2j, 2j+1), got global "
                         f"rows {rows[k].tolist()}: the sharding split the pairs; shard with "
                         f"shard_batch(batch, mesh) or shard_batch(batch, mesh, group_size=2)")


def _check_container(batch) -> int:
    if not isinstance(batch, TensorDictBase):
        raise BatchError(f"batch: must be a tensordict.TensorDict, got {type(batch).__name__}; "
                         "build one with TensorDict({...}, batch_size=[B])")
    if len(batch.batch_size) != 1:
        raise BatchError(f"batch: batch_size must be [B] (one dim, the rows), got "
                         f"{list(batch.batch_size)}")
    B = batch.batch_size[0]
    if B < 1:
        raise BatchError("batch: must hold at least one row, got "
                         f"batch_size={list(batch.batch_size)}")
    return B


def _check_required(batch, required: Sequence[str], why: Mapping[str, str]) -> None:
    present = set(batch.keys())
    for key in dict.fromkeys(required):  # ordered, without repeats
        if key not in present:
            layout = key in (K.INPUT_IDS, K.ATTENTION_MASK)
            reason = why.get(key, "the public batch layout" if layout else (
                "the loss: bool [B, T], True on the tokens it trains (the response), False on "
                "the prompt and padding" if key == K.LOSS_MASK else "this call"))
            raise BatchError(f"batch is missing key {key!r} (needed for {reason}); keys present: "
                             f"{sorted(present)}")


def _check_tensor(key, x, dtype, shape, B) -> None:
    if not isinstance(x, torch.Tensor):
        raise BatchError(f"{key}: must be a tensor, got {type(x).__name__}")
    if x.dtype != dtype:
        hint = ""  # a tokenizer's int64 attention mask, int32 ids: the conversion named
        if dtype == torch.bool and x.dtype != torch.bool:
            hint = f" (a 0/1 mask converts with {key}.bool())"
        elif dtype == torch.int64 and not (x.is_floating_point() or x.is_complex()
                                           or x.dtype == torch.bool):
            hint = f" (convert with {key}.long())"
        raise BatchError(f"{key}: must have dtype {dtype}, got {x.dtype}{hint}")
    if shape is None:  # input_ids fixes T
        if x.ndim != 2 or x.shape[1] < 1:
            raise BatchError(f"{key}: must have shape [B, T] with B={B}, T >= 1, got "
                             f"{list(x.shape)}")
    elif tuple(x.shape) != tuple(shape):
        want = "[B]" if len(shape) == 1 else "[B, T]"
        raise BatchError(f"{key}: must have shape {want} = {list(shape)}, got {list(x.shape)}")


def _first(bad: torch.Tensor) -> tuple[int, ...]:
    """Index of the first True of `bad` (row-major), as Python ints."""
    return tuple(int(i) for i in bad.nonzero()[0])


def check_prefix_mask(attn: torch.Tensor) -> None:
    empty = ~attn.any(dim=1)
    if empty.any():
        b = _first(empty)[0]
        raise BatchError(f"{K.ATTENTION_MASK}: every row needs at least one real token (True), got "
                         f"a row of all False at row {b}; drop empty rows before calling fsdpfn")
    gap = attn[:, 1:] & ~attn[:, :-1]  # True right after a False: not a prefix
    if gap.any():
        b, t = _first(gap)
        raise BatchError(f"{K.ATTENTION_MASK}: must be a contiguous prefix of True per row "
                         f"(right padding), got True at row {b}, t={t + 1} after False at t={t}")


def _check_token_ids(ids, attn, vocab_size) -> None:
    bad = attn & (ids < 0)
    rule = "must be >= 0 on real tokens"
    if vocab_size is not None:
        bad = bad | (attn & (ids >= vocab_size))
        rule = f"must be in [0, vocab_size={vocab_size}) on real tokens"
    if bad.any():
        b, t = _first(bad)
        raise BatchError(f"{K.INPUT_IDS}: {rule}, got {int(ids[b, t])} at row {b}, t={t}")


def _check_loss_mask(lm, attn, shape, B, *, nonempty: bool) -> None:
    _check_tensor(K.LOSS_MASK, lm, torch.bool, shape, B)
    if lm[:, 0].any():
        b = _first(lm[:, 0])[0]
        raise BatchError(f"{K.LOSS_MASK}: must be False at t=0 (the first token has no "
                         f"log-prob), got True at row {b}, t=0")
    outside = lm & ~attn
    if outside.any():
        b, t = _first(outside)
        raise BatchError(f"{K.LOSS_MASK}: must imply {K.ATTENTION_MASK}, got True at row {b}, "
                         f"t={t} where {K.ATTENTION_MASK} is False")
    if nonempty and not lm.any():
        raise BatchError(f"{K.LOSS_MASK}: must have at least one True, got none (all {B} rows "
                         "are all False; nothing would be trained on)")


def _check_finite(key, x, attn) -> None:
    bad = ~torch.isfinite(x)
    if attn is not None:
        bad = bad & attn
    if bad.any():
        idx = _first(bad)
        where = f"row {idx[0]}" + (f", t={idx[1]}" if len(idx) > 1 else "")
        what = "on real tokens" if attn is not None else "in every row"
        raise BatchError(f"{key}: must be finite {what}, got {float(x[idx])} at {where}")


def check_rows(B: int, group_size: int | None, pairs: bool) -> None:
    if pairs and B % 2:  # pairs first: a pair is the group a pairwise loss names
        raise BatchError(f"batch: B must be even for pairs (row 2i chosen, 2i+1 rejected), "
                         f"got B={B}")
    if group_size is not None:
        config_int("group_size", group_size)
        if B % group_size:
            raise BatchError(f"batch: B must be divisible by group_size={group_size} (rows "
                             f"[k*G, (k+1)*G) form group k), got B={B}")


def config_int(name: str, value, lo: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < lo:
        raise ConfigError(f"{name}: must be an int >= {lo}, got {value!r}")


# ================================================================ rows


def row_lengths(batch) -> list[int]:
    """Real tokens per row, sum of attention_mask[B, T] over T, as Python ints [B]."""
    return batch.get(K.ATTENTION_MASK).sum(dim=1).tolist()


def rows_tensor(rows, B: int, device) -> torch.Tensor:
    r = torch.as_tensor(list(rows) if not isinstance(rows, torch.Tensor) else rows,
                        dtype=torch.int64).to(device).reshape(-1)
    if r.numel() and (int(r.min()) < 0 or int(r.max()) >= B):
        raise BatchError(f"rows: must be in [0, B={B}), got {r.tolist()}")
    return r


def select_rows(batch: TensorDictBase, rows) -> TensorDictBase:
    """New TensorDict of batch[rows] (rows: ints or int64 tensor), in the order given."""
    return batch[rows_tensor(rows, batch.batch_size[0], batch.device or "cpu")]
