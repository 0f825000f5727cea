"""Every algorithm passes one contract table (optax-style) and learns on a tiny model."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

import fsdpfn as ff
from fsdpfn import keys as K
from fsdpfn.testing import random_batch, sharded_logits, tiny_qwen2_config

COMMON = {"loss", "grad_norm", "lr", "tokens", "skipped", "steps"}
STATS = {
    "sft": COMMON,
    "ppo": COMMON | {"pg_loss", "clip_frac", "dual_clip_frac", "approx_kl", "ratio_mean",
                     "ratio_max", "entropy", "kl"},
    "critic": COMMON | {"vf_clip_frac", "value_mean", "returns_mean"},
    "rw": COMMON | {"accuracy", "margin", "chosen_score", "rejected_score"},
    "dpo": COMMON | {"reward_accuracy", "chosen_reward", "rejected_reward", "margin"},
}


def _state(*, critic=False, lr=1e-3, optimizer=True, seed=1):
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=-1), device_type="cpu")
    cfg = ff.EngineConfig(model_config=tiny_qwen2_config().to_dict(), dtype="float32",
                          is_critic=critic, seed=seed,
                          optimizer=ff.OptimizerConfig(lr=lr) if optimizer else None)
    return ff.shard_model(cfg, mesh)


def _batch(name, state, ref):
    batch = random_batch(8, 12, seed=7, group_size=4)
    if name == "ppo":
        batch = ff.forward_logp(ref, batch, out_key=K.REF_LOGP)
        batch = ff.forward_logp(state, batch, out_key=K.OLD_LOGP)
        return ff.compute_advantages(batch, ff.AdvantageConfig(estimator="grpo", group_size=4))
    if name == "critic":
        batch = ff.compute_values(state, batch)
        return ff.compute_advantages(batch, ff.AdvantageConfig(estimator="gae", gamma=0.9,
                                                               lam=0.95))
    if name == "dpo":
        return ff.forward_logp(ref, batch, out_key=K.REF_LOGP)
    return batch


def _step(name, state, batch):
    if name == "sft":
        return ff.sft_step(state, batch, ff.SFTConfig())
    if name == "ppo":
        return ff.ppo_step(state, batch, ff.PPOConfig(n_minibatches=2, shuffle=True,
                                                      entropy_coef=0.01, kl_coef=0.05))
    if name == "critic":
        return ff.critic_step(state, batch, ff.CriticConfig())
    if name == "rw":
        return ff.rw_step(state, batch, ff.RWConfig())
    return ff.dpo_step(state, batch, ff.DPOConfig(beta=0.1))


def contract(name):
    critic = name in ("critic", "rw")
    state = _state(critic=critic)
    ref = _state(optimizer=False)
    batch = _batch(name, state, ref)
    version, step = state.version, state.step
    new, stats = _step(name, state, batch)
    result = {"keys": set(stats.keys()), "finite": all(torch.isfinite(v) for v in stats.values()),
              "version": (version, new.version), "step": (step, new.step),
              "steps": float(stats["steps"])}
    try:
        _step(name, state, batch)
        result["stale"] = None
    except ff.StaleStateError as exc:
        result["stale"] = str(exc)
    new2, _ = _step(name, new, batch)  # the successor is live
    result["version2"] = new2.version
    return result


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["sft", "ppo", "critic", "rw", "dpo"])
def test_contract(name, spmd2):
    for res in spmd2.run(contract, args=(name,), timeout=240):
        assert STATS[name] <= res["keys"], STATS[name] - res["keys"]
        assert res["finite"]
        assert res["version"][1] == res["version"][0] + 1 and res["version2"] == res["version"][1] + 1
        expected_steps = 2 if name == "ppo" else 1
        assert res["step"][1] == res["step"][0] + expected_steps == res["steps"]
        assert res["stale"] is not None and f"superseded by {name}_step()" in res["stale"]


# ---------------------------------------------------------------- learning


def learn_supervised(name, steps):
    critic = name == "rw"
    state = _state(critic=critic, lr=3e-3)
    ref = _state(optimizer=False)
    batch = _batch(name, state, ref)
    losses = []
    for _ in range(steps):
        state, stats = _step(name, state, batch)
        losses.append(float(stats["loss"]))
    return losses


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["sft", "rw", "dpo"])
def test_loss_halves(name, spmd1):
    losses = spmd1.run(learn_supervised, args=(name, 30), timeout=240)[0]
    assert min(losses[-5:]) <= 0.5 * losses[0], losses


def learn_bandit(iterations):
    """A one-token bandit: reward 1 for a response token below 16 (1/8 of the vocabulary)."""
    state = _state(lr=2e-2)
    gen = torch.Generator().manual_seed(0)
    G, groups, T = 8, 4, 3
    means = []
    for _ in range(iterations):
        prompts = torch.randint(16, 128, (groups, 2), generator=gen).repeat_interleave(G, 0)
        probs = torch.softmax(sharded_logits(state, prompts)[:, -1], -1)
        response = torch.multinomial(probs, 1, generator=gen)
        ids = torch.cat([prompts, response], 1)
        loss_mask = torch.zeros(G * groups, T, dtype=torch.bool)
        loss_mask[:, 2] = True
        rewards = (response[:, 0] < 16).float()
        means.append(float(rewards.mean()))
        batch = TensorDict({K.INPUT_IDS: ids, K.ATTENTION_MASK: torch.ones_like(loss_mask),
                            K.LOSS_MASK: loss_mask, K.REWARDS: rewards}, batch_size=[G * groups])
        batch = ff.forward_logp(state, batch, out_key=K.OLD_LOGP)
        batch = ff.compute_advantages(batch, ff.AdvantageConfig(estimator="grpo", group_size=G))
        state, _ = ff.ppo_step(state, batch, ff.PPOConfig(n_minibatches=2))
    return means


@pytest.mark.timeout(300)
def test_ppo_raises_mean_reward(spmd1):
    means = spmd1.run(learn_bandit, args=(25,), timeout=240)[0]
    start, end = sum(means[:5]) / 5, sum(means[-5:]) / 5
    assert end > start + 0.3, means


def evaluate_matches_step_loss():
    from fsdpfn.algos.sft import sft_loss_fn

    state = _state(lr=1e-2)
    batch = random_batch(8, 12, seed=4)
    before = ff.evaluate(state, batch, sft_loss_fn(ff.SFTConfig()))
    version = state.version
    new, stats = ff.sft_step(state, batch, ff.SFTConfig())
    after = ff.evaluate(new, batch, sft_loss_fn(ff.SFTConfig()))
    return (float(before["loss"]), float(stats["loss"]), float(after["loss"]), version,
            new.version, float(before["tokens"]), float(stats["tokens"]))


@pytest.mark.timeout(200)
def test_evaluate_reports_the_loss_without_changing_the_state(spmd2):
    for before, step_loss, after, v0, v1, tok_eval, tok_step in spmd2.run(
            evaluate_matches_step_loss, timeout=150):
        # the step's loss is computed before its update: evaluate must see the same number
        assert abs(before - step_loss) < 1e-6 * max(1.0, abs(step_loss))
        assert after < before and v1 == v0 + 1 and tok_eval == tok_step
