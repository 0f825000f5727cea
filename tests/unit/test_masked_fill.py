"""A finite fill where loss_mask is False changes no loss, statistic or gradient.

Pipelines often fill untrained positions with `torch.finfo(torch.float32).min` (the usual
`masked_fill(~mask, finfo.min)`). Such a value is finite, so the batch is valid, yet k2's backward
once formed 2·d = inf there and multiplied it by the zero upstream gradient: the gradient norm
was NaN and ppo_step skipped its optimizer step with no error.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import fsdpfn as ff
from fsdpfn import keys as K
from fsdpfn import ops
from fsdpfn.testing import random_batch, tiny_qwen2_config, with_ppo_keys
from fsdpfn.testing.models import full_model_state

FMIN = torch.finfo(torch.float32).min


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "abs"])
def test_kl_gradient_is_the_reference_with_a_fill_at_masked_positions(kind):
    mask = torch.tensor([[False, True, True, False], [False, False, True, True]])
    logp = torch.tensor([[0.0, -1.0, -2.0, -0.5], [-3.0, -0.2, -0.7, -1.1]])
    ref = torch.where(mask, torch.tensor([[0.0, -1.5, -1.0, 0.0], [0.0, 0.0, -0.4, -2.0]]),
                      torch.tensor(FMIN))
    x = logp.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(ops.aggregate(ops.kl(x, ref, kind), mask, "token-mean"), x)
    # float64 reference: d/dlogp of the token mean of each estimator over the masked tokens
    d = (logp.double() - ref.double()) * mask
    per = {"k1": torch.ones_like(d), "k2": d, "k3": 1.0 - torch.exp(-d), "abs": torch.sign(d)}
    want = torch.where(mask, per[kind], torch.zeros_like(d)) / mask.sum()
    assert torch.isfinite(g).all(), g
    torch.testing.assert_close(g.double(), want, rtol=1e-6, atol=1e-7)


def _state(mesh):
    cfg = ff.EngineConfig(model_config=tiny_qwen2_config().to_dict(), dtype="float32", seed=3,
                          optimizer=ff.OptimizerConfig(lr=1e-2))
    return ff.shard_model(cfg, mesh)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "abs"])
def test_ppo_step_with_a_fill_in_ref_logp_over_the_prompt_equals_the_clean_step(kind):
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=-1), device_type="cpu")
    batch = with_ppo_keys(random_batch(4, 10, seed=0, min_len=5, prompt_len=3), seed=100)
    lm = batch[K.LOSS_MASK]
    prompt = batch[K.ATTENTION_MASK] & ~lm
    filled = batch.clone()
    filled[K.REF_LOGP] = torch.where(prompt, torch.tensor(FMIN), batch[K.REF_LOGP])
    cfg = ff.PPOConfig(kl_coef=0.1, kl_kind=kind)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        clean, st0 = ff.ppo_step(_state(mesh), batch, cfg)
        dirty, st1 = ff.ppo_step(_state(mesh), filled, cfg)
    assert float(st1["skipped"]) == 0.0 and float(st1["steps"]) == 1.0
    for key in ("loss", "kl", "grad_norm"):
        assert float(st1[key]) == float(st0[key]), key
    w0, w1 = full_model_state(clean), full_model_state(dirty)
    for name in w0:
        assert torch.equal(w0[name], w1[name]), name
