"""PPO without an old_logp pass: with one minibatch the training forward stands in for old_logp.

With n_minibatches=1 the update starts at the weights a separate forward_logp pass would use, so
the ratio is 1 by construction. The references: the same step given old_logp from forward_logp,
and the plain policy gradient -sum(A * logp) / N written out as its own loss (at ratio 1 the
clipped objective's gradient is exactly that), with pg_loss against float64 math on the batch.
"""

from __future__ import annotations

import pytest
import torch

import fsdpfn as ff
from fsdpfn import keys as K
from fsdpfn.testing import random_batch, tiny_qwen2_config


def _state():
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=-1), device_type="cpu")
    cfg = ff.EngineConfig(model_config=tiny_qwen2_config().to_dict(), dtype="float32", seed=2,
                          optimizer=ff.OptimizerConfig(lr=1e-3))
    return ff.shard_model(cfg, mesh)


def _batch(mesh):
    full = random_batch(8, 12, seed=11, group_size=4)
    full = ff.compute_advantages(full, ff.AdvantageConfig(estimator="grpo", group_size=4))
    return full, ff.shard_batch(full, mesh, group_size=4)


def _reinforce(outputs, mb, ctx):
    mask = mb[K.LOSS_MASK]
    loss = -(torch.where(mask, mb[K.ADVANTAGES] * outputs[K.LOGP], 0.0)).sum()
    return loss, {}


def old_logp_from_the_forward():
    full, batch = _batch(_state().mesh)
    with_old = ff.forward_logp(probe := _state(), batch, out_key=K.OLD_LOGP)
    _, given = ff.ppo_step(probe, with_old, ff.PPOConfig())                  # the batch's old_logp
    _, auto = ff.ppo_step(_state(), batch, ff.PPOConfig(old_logp_from="auto"))  # none given
    _, forced = ff.ppo_step(_state(), with_old, ff.PPOConfig(old_logp_from="forward"))
    _, pg = ff.grad_step(_state(), batch, _reinforce)
    mask = full[K.LOSS_MASK]
    expected = float(-(full[K.ADVANTAGES].double() * mask).sum() / mask.sum())  # ratio 1
    refused = []
    for call in (lambda: ff.ppo_step(_state(), batch, ff.PPOConfig(old_logp_from="batch")),
                 lambda: ff.ppo_step(_state(), batch, ff.PPOConfig(n_minibatches=2,
                                                                   old_logp_from="auto"))):
        try:
            call()
            refused.append(None)
        except ff.BatchError as exc:
            refused.append(str(exc))
    stats = {name: {k: float(s[k]) for k in ("pg_loss", "loss", "grad_norm", "ratio_max",
                                             "clip_frac")}
             for name, s in (("given", given), ("auto", auto), ("forced", forced))}
    return stats, float(pg["grad_norm"]), expected, refused


@pytest.mark.timeout(240)
def test_one_minibatch_takes_old_logp_from_the_training_forward(spmd2):
    stats, pg_norm, expected, refused = spmd2.run(old_logp_from_the_forward, timeout=200)[0]
    for name in ("auto", "forced"):
        s = stats[name]
        assert s["ratio_max"] == 1.0 and s["clip_frac"] == 0.0, (name, s)
        assert abs(s["pg_loss"] - expected) <= 1e-6 * max(1.0, abs(expected)), (name, s, expected)
        # the same gradient as the step given old_logp, and as the plain policy gradient
        for ref in (stats["given"]["grad_norm"], pg_norm):
            assert abs(s["grad_norm"] - ref) <= 1e-5 * ref, (name, s, ref)
    assert all(r is not None and "old_logp" in r for r in refused), refused
    assert "old_logp_from='batch'" in refused[0] and "n_minibatches=2" in refused[1], refused
    # the default is the contract's: ppo_step needs old_logp
    assert ff.PPOConfig().old_logp_from == "batch"


def test_forward_needs_one_minibatch():
    with pytest.raises(ff.ConfigError, match=r"old_logp_from: 'forward' needs n_minibatches=1.*"
                                             r"got n_minibatches=2"):
        ff.PPOConfig(old_logp_from="forward", n_minibatches=2)
    with pytest.raises(ff.ConfigError, match="old_logp_from"):
        ff.PPOConfig(old_logp_from="never")


def old_logp_from_behav():
    state = _state()
    _, batch = _batch(state.mesh)
    logp = ff.forward_logp(state, batch, out_key=K.LOGP)[K.LOGP]
    behav = torch.where(batch[K.LOSS_MASK], logp + 0.01, torch.zeros(()))    # a sampler 0.01 off
    batch = batch.copy().set(K.BEHAV_LOGP, behav)
    config = ff.PPOConfig(n_minibatches=2, old_logp_from="behav", check_on_policy=True,
                          on_policy_tol=1.0)
    _, approx = ff.ppo_step(state, batch, config)
    as_old = batch.copy().set(K.OLD_LOGP, behav)
    _, given = ff.ppo_step(_state(), as_old, ff.PPOConfig(n_minibatches=2))
    try:
        ff.ppo_step(_state(), batch.exclude(K.BEHAV_LOGP), config)
        refused = None
    except ff.BatchError as exc:
        refused = str(exc)
    return ({k: float(approx[k]) for k in ("on_policy_gap", "grad_norm", "loss")},
            {k: float(given[k]) for k in ("grad_norm", "loss")}, refused)


@pytest.mark.timeout(240)
def test_behav_stands_in_for_old_logp_and_its_gap_is_measured(spmd2):
    approx, given, refused = spmd2.run(old_logp_from_behav, timeout=200)[0]
    assert abs(approx["on_policy_gap"] - 0.01) <= 1e-4, approx  # |proximal - behav| measured
    assert approx["grad_norm"] == pytest.approx(given["grad_norm"], rel=1e-6), (approx, given)
    assert approx["loss"] == pytest.approx(given["loss"], rel=1e-6, abs=1e-7), (approx, given)
    assert refused is not None and "behav_logp" in refused and "old_logp_from='behav'" in refused
