"""The hypothesis strategies fsdpfn.testing ships produce what they promise: valid public
batches, whole groups sharing a prompt, pairs sharing a prompt, mesh layouts of the world size."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdpfn import keys as K
from fsdpfn.batch import validate_batch
from fsdpfn.testing.strategies import (grouped_batches, mesh_layouts, paired_batches,
                                       public_batches, ragged_lengths)

FAST = settings(max_examples=40, deadline=None)


@FAST
@given(ragged_lengths(max_rows=5, max_len=9))
def test_ragged_lengths_fit_their_width(drawn):
    lengths, T = drawn
    assert 1 <= len(lengths) <= 5 and T <= 9 and all(1 <= n <= T for n in lengths)


@FAST
@given(public_batches())
def test_public_batches_are_valid(batch):
    validate_batch(batch, require=(K.REWARDS,))
    assert bool(batch[K.LOSS_MASK].any(-1).all()) and not bool(batch[K.LOSS_MASK][:, 0].any())


@FAST
@given(grouped_batches())
def test_grouped_batches_hold_whole_groups_sharing_a_prompt(drawn):
    batch, G = drawn
    validate_batch(batch, require=(K.REWARDS, K.GROUP_ID))
    ids = batch[K.GROUP_ID].tolist()
    assert all(ids.count(g) == G for g in set(ids))
    for g in set(ids):
        rows = [i for i, x in enumerate(ids) if x == g]
        first_loss = batch[K.LOSS_MASK][rows[0]].long().argmax()
        prompts = batch[K.INPUT_IDS][rows, :first_loss]
        assert bool((prompts == prompts[0]).all())


@FAST
@given(paired_batches())
def test_paired_batches_share_prompts(batch):
    validate_batch(batch, require=(K.REWARDS,))
    assert batch.batch_size[0] % 2 == 0
    for i in range(0, batch.batch_size[0], 2):
        p = int(batch[K.LOSS_MASK][i].long().argmax())
        assert torch.equal(batch[K.INPUT_IDS][i, :p], batch[K.INPUT_IDS][i + 1, :p])


@FAST
@given(st.integers(1, 12).flatmap(lambda w: st.tuples(st.just(w), mesh_layouts(w))))
def test_mesh_layouts_multiply_to_the_world(drawn):
    world, layout = drawn
    assert math.prod(layout.values()) == world and set(layout) == {"dp", "tp", "cp"}
