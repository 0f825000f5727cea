"""Hypothesis strategies for property tests of algorithms on fsdpfn's public formats.

    from hypothesis import given
    from fsdpfn.testing.strategies import grouped_batches, mesh_layouts

    @given(grouped_batches(max_groups=4, max_group_size=4))
    def test_my_estimator_ignores_row_order(drawn):
        batch, group_size = drawn
        ...

Every batch is a right-padded TensorDict in docs/api.md's layout (input_ids, attention_mask,
loss_mask never at t=0, rewards, and on request group_id or chosen/rejected pairs), drawn from a
seed so a failing example shrinks to small, readable sizes. Inside ranks of a run_spmd test use
``settings(derandomize=True, database=None)`` so every rank draws the same examples.
"""

from __future__ import annotations

import torch
from hypothesis import strategies as st
from tensordict import TensorDict

from fsdpfn import keys as K
__all__ = ["ragged_lengths", "public_batches", "grouped_batches", "paired_batches",
           "mesh_layouts", "batch_from_lengths"]


def batch_from_lengths(lengths: list[int], T: int, *, seed: int, vocab_size: int = 128,
                       prompt_lens: list[int] | None = None) -> TensorDict:
    """A public batch whose row i has ``lengths[i]`` real tokens (right padded to T); the
    loss mask covers each row's tokens after its prompt (``prompt_lens``, default 1: every
    token but the first); rewards in [0, 1)."""
    g = torch.Generator().manual_seed(seed)
    B = len(lengths)
    lens = torch.tensor(lengths)
    attn = torch.arange(T)[None] < lens[:, None]                         # (B, T)
    ids = torch.where(attn, torch.randint(0, vocab_size, (B, T), generator=g), 0)
    prompt = torch.tensor(prompt_lens or [1] * B).clamp(min=1)
    loss = attn & (torch.arange(T)[None] >= prompt[:, None])
    return TensorDict({K.INPUT_IDS: ids, K.ATTENTION_MASK: attn, K.LOSS_MASK: loss,
                       K.REWARDS: torch.rand(B, generator=g)}, batch_size=[B])


@st.composite
def ragged_lengths(draw, *, max_rows: int = 8, max_len: int = 16, min_len: int = 1):
    """(lengths, T): 1..max_rows row lengths in [min_len, T], T <= max_len."""
    T = draw(st.integers(min_len, max_len))
    lengths = draw(st.lists(st.integers(min_len, T), min_size=1, max_size=max_rows))
    return lengths, T


@st.composite
def public_batches(draw, *, max_rows: int = 8, max_len: int = 16, vocab_size: int = 128):
    """A public batch of ragged rows (at least 2 tokens each, so every row has a loss token)."""
    lengths, T = draw(ragged_lengths(max_rows=max_rows, max_len=max(max_len, 2), min_len=2))
    prompts = [draw(st.integers(1, n - 1)) for n in lengths]
    return batch_from_lengths(lengths, T, seed=draw(st.integers(0, 2**16)),
                              vocab_size=vocab_size, prompt_lens=prompts)


@st.composite
def grouped_batches(draw, *, max_groups: int = 6, max_group_size: int = 4, max_len: int = 12,
                    vocab_size: int = 128, shuffled: bool = True):
    """(batch, G): groups of G rows sharing a prompt, marked by ``group_id`` (arbitrary,
    non-contiguous ids; rows of a group scattered in the batch when ``shuffled``)."""
    G = draw(st.integers(1, max_group_size))
    n = draw(st.integers(1, max_groups))
    ids = [7 * g + 3 for g in range(n) for _ in range(G)]
    if shuffled:
        ids = draw(st.permutations(ids))
    T = draw(st.integers(3, max(max_len, 3)))
    prompt = {g: draw(st.integers(1, 2)) for g in set(ids)}
    lengths = [draw(st.integers(prompt[g] + 1, T)) for g in ids]
    batch = batch_from_lengths(lengths, T, seed=draw(st.integers(0, 2**16)),
                               vocab_size=vocab_size, prompt_lens=[prompt[g] for g in ids])
    first = {}
    input_ids = batch.get(K.INPUT_IDS)
    for row, g in enumerate(ids):  # the rows of a group share their prompt tokens
        first.setdefault(g, row)
        input_ids[row, :prompt[g]] = input_ids[first[g], :prompt[g]]
    batch.set(K.GROUP_ID, torch.tensor(ids, dtype=torch.int64))
    return batch, G


@st.composite
def paired_batches(draw, *, max_pairs: int = 4, max_len: int = 12, vocab_size: int = 128):
    """Preference pairs: row 2i chosen, row 2i+1 rejected, sharing their prompt."""
    n = draw(st.integers(1, max_pairs))
    T = draw(st.integers(3, max(max_len, 3)))
    prompts = [draw(st.integers(1, 2)) for _ in range(n)]
    lengths = [draw(st.integers(p + 1, T)) for p in prompts for _ in range(2)]
    batch = batch_from_lengths(lengths, T, seed=draw(st.integers(0, 2**16)),
                               vocab_size=vocab_size,
                               prompt_lens=[p for p in prompts for _ in range(2)])
    input_ids = batch.get(K.INPUT_IDS)
    for i, p in enumerate(prompts):
        input_ids[2 * i + 1, :p] = input_ids[2 * i, :p]
    return batch


@st.composite
def mesh_layouts(draw, world_size: int, *, axes: tuple[str, ...] = ("dp", "tp", "cp")):
    """A dict {dp, tp, cp} whose product is ``world_size`` (axes not named stay 1), for
    ``ParallelStrategy(**layout)``."""
    layout = {"dp": 1, "tp": 1, "cp": 1}
    rest = world_size
    for axis in axes[:-1]:
        divisors = [d for d in range(1, rest + 1) if rest % d == 0]
        layout[axis] = draw(st.sampled_from(divisors))
        rest //= layout[axis]
    layout[axes[-1]] = rest
    return layout
