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
