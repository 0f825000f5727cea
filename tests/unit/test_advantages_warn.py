"""A grouped estimator over groups of one row gives zero advantages: said once, as a warning."""

from __future__ import annotations

import warnings

import pytest
import torch
from tensordict import TensorDict

import fsdpfn as ff


def _batch(B=4, T=6):
    mask = torch.ones(B, T, dtype=torch.bool)
    loss = mask.clone()
    loss[:, :2] = False
    return TensorDict({"input_ids": torch.ones(B, T, dtype=torch.long), "attention_mask": mask,
                       "loss_mask": loss, "rewards": torch.arange(B, dtype=torch.float32)},
                      batch_size=[B])


def test_groups_of_one_row_warn_that_every_advantage_is_zero():
    with pytest.warns(UserWarning, match="group_size is 1 with estimator 'grpo'.*every "
                                         "advantage is 0"):
        out = ff.compute_advantages(_batch(), ff.AdvantageConfig())
    assert float(out["advantages"].abs().sum()) == 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ff.compute_advantages(_batch(), ff.AdvantageConfig(group_size=2))
        ff.compute_advantages(_batch(), ff.AdvantageConfig(group_size=4, estimator="rloo"))


@pytest.mark.parametrize("estimator", ["grpo", "drgrpo", "rloo"])
def test_a_grouped_estimator_warns_that_it_does_not_read_dense_rewards(estimator):
    batch = _batch()
    dense = batch.copy()
    dense["token_rewards"] = torch.full((4, 6), 0.5)
    config = ff.AdvantageConfig(estimator=estimator, group_size=2)
    with pytest.warns(UserWarning, match=f"batch key 'token_rewards': estimator '{estimator}' "
                                         f"reads the outcome 'rewards' only"):
        out = ff.compute_advantages(dense, config)
    # the warning says what happens: the advantages are those of the batch without the key
    assert torch.equal(out["advantages"], ff.compute_advantages(batch, config)["advantages"])


@pytest.mark.parametrize("estimator", ["reinforce++", "gae"])
def test_the_token_level_estimators_add_dense_rewards_without_a_warning(estimator):
    batch = _batch()
    batch["values"] = torch.zeros(4, 6)
    dense = batch.copy()
    dense["token_rewards"] = torch.zeros(4, 6)
    dense["token_rewards"][:, 3] = 1.0
    config = ff.AdvantageConfig(estimator=estimator)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = ff.compute_advantages(dense, config)
    # returns-to-go at t=2 (gamma 1): the outcome plus the one dense reward after it
    assert torch.allclose(out["returns"][:, 2], batch["rewards"] + 1.0)
