"""Rollout corrections inside ppo_step on gloo ranks: dp=2 gives the stats of dp=1 (weights and
masks are per row and rows are never split; fractions are divided by global counts, maxima are
max-reduced), a missing behav_logp is a BatchError, and the first-step on-policy check warns only
when the first minibatch's ratio is not 1."""

from __future__ import annotations

import warnings

import pytest
import torch

import fsdpfn as ff
from fsdpfn import keys as K
from fsdpfn.engine import timing
from fsdpfn.testing import random_batch, tiny_qwen2_config

CONFIGS = [
    dict(behav_cap=1.2),
    dict(behav_correction="tis", behav_level="token", behav_high=1.3),
    dict(behav_correction="tis", behav_level="sequence", behav_low=0.5, behav_high=2.0),
    dict(behav_correction="mis", behav_level="token", behav_high=1.3),
    dict(behav_correction="mis", behav_level="sequence", behav_high=3.0),
    dict(behav_correction="mis", behav_level="geometric", behav_high=1.1),
    dict(policy_loss="cispo", cispo_clip_high=0.1, behav_correction="mis", behav_high=1.5),
]
DIAGNOSTICS = {"behav_gap_mean", "behav_gap_max", "behav_kl", "behav_weight_mean",
               "behav_weight_max", "behav_trunc_frac", "behav_mask_frac",
               "behav_seq_trunc_frac", "behav_seq_mask_frac"}


def _state():
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=-1), device_type="cpu")
    cfg = ff.EngineConfig(model_config=tiny_qwen2_config().to_dict(), dtype="float32", seed=1,
                          optimizer=ff.OptimizerConfig(lr=1e-3))
    return ff.shard_model(cfg, mesh)


def _global_batch(state):
    """Old log-probs of the tiny model, behaviour log-probs 0.3-noisy around them, advantages:
    the same global batch on every rank, whatever dp."""
    batch = random_batch(8, 12, seed=7, group_size=4)
    batch = ff.forward_logp(state, batch, out_key=K.OLD_LOGP)
    noise = torch.randn(batch[K.OLD_LOGP].shape, generator=torch.Generator().manual_seed(3))
    behav = torch.where(batch[K.LOSS_MASK], batch[K.OLD_LOGP] + 0.3 * noise, torch.zeros(()))
    batch = batch.copy().set(K.BEHAV_LOGP, behav)
    return ff.compute_advantages(batch, ff.AdvantageConfig(estimator="grpo", group_size=4))


def corrected_steps(configs):
    """One ppo_step per config, chained on one state; returns each step's stats."""
    state = _state()
    batch = ff.shard_batch(_global_batch(state), state.mesh, group_size=4)
    out = []
    for kwargs in configs:
        state, stats = ff.ppo_step(state, batch, ff.PPOConfig(**kwargs))
        out.append({k: float(v) for k, v in stats.items()})
    return out


@pytest.mark.timeout(540)
def test_corrections_dp2_equal_dp1(spmd1, spmd2):
    one = spmd1.run(corrected_steps, args=(CONFIGS,), timeout=240)[0]
    two = spmd2.run(corrected_steps, args=(CONFIGS,), timeout=240)
    assert two[0] == two[1]  # identical on all ranks
    for kwargs, a, b in zip(CONFIGS, one, two[0]):
        assert DIAGNOSTICS <= set(a) and set(a) == set(b), (kwargs, DIAGNOSTICS - set(a))
        for key in a.keys() - timing.KEYS:  # measured times differ from run to run
            assert abs(a[key] - b[key]) <= 1e-5 * max(1.0, abs(a[key])), (kwargs, key, a[key], b[key])
    masked = [s["behav_mask_frac"] for s in one[3:6]]
    assert all(0.0 < m < 1.0 for m in masked), masked  # the masks did drop some tokens, not all
    assert 0.0 < one[1]["behav_trunc_frac"] < 1.0 and one[0]["behav_trunc_frac"] > 0.0
    assert one[4]["behav_seq_mask_frac"] > 0.0 and one[1]["behav_weight_max"] <= 1.3 + 1e-6


def missing_behav_and_on_policy():
    state = _state()
    batch = _global_batch(state)
    without = batch.exclude(K.BEHAV_LOGP)
    try:
        ff.ppo_step(state, without, ff.PPOConfig(behav_correction="mis"))
        error = None
    except ff.BatchError as exc:
        error = str(exc)
    check = ff.PPOConfig(check_on_policy=True, n_minibatches=2)
    with warnings.catch_warnings(record=True) as fresh:
        warnings.simplefilter("always")
        state, stats = ff.ppo_step(state, batch, check)  # the state is still usable after the error
    gap_fresh = float(stats["on_policy_gap"])
    with warnings.catch_warnings(record=True) as stale:
        warnings.simplefilter("always")
        state, stats = ff.ppo_step(state, batch, check)  # old_logp now from the weights before
    return (error, [str(w.message) for w in fresh], gap_fresh,
            [str(w.message) for w in stale], float(stats["on_policy_gap"]))


@pytest.mark.timeout(200)
def test_missing_behav_logp_is_a_batch_error_and_on_policy_check(spmd1):
    error, fresh, gap_fresh, stale, gap_stale = spmd1.run(missing_behav_and_on_policy, timeout=150)[0]
    assert error is not None and "behav_logp" in error and "behav_correction='mis'" in error, error
    assert not [m for m in fresh if "check_on_policy" in m] and gap_fresh < 1e-5, (fresh, gap_fresh)
    assert gap_stale > 1e-3 and any("not pushed" in m and "temperature" in m for m in stale), stale
