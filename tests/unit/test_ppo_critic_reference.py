"""ppo_step's and critic_step's losses, stats and gradient against float64 references.

The references are written here from the docs (docs/api.md: ``policy_loss``, ``kl``,
``aggregate``, ``value_loss``, "Minibatches and stats"; the PPOConfig and CriticConfig
docstrings): the policy term max(−A·r, −A·clamp(r, 1 − clip_low, 1 + clip_high)) with dual_clip
capping tokens with A < 0 at c·|A|, minus entropy_coef times the aggregated entropy, plus
kl_coef times the aggregated ``kl_kind`` estimate of logp against ref_logp; the critic's
½·max((v − R)², (clip(v, v_old ± value_clip) − R)²). PPO's reference model is the HF model
loaded from the same directory in float64, so the step's `grad_norm` (before clipping) is
checked against a float64 backward too. Every option is off its default, and the batch's
ratios reach past both clip bounds, so a wrong sign, a dropped term or a bound taken from the
wrong field changes a compared number.
"""

from __future__ import annotations

import math

import pytest
import torch

import fsdpfn as ff
from fsdpfn import keys as K
from fsdpfn.testing import random_batch, save_tiny_model, tiny_qwen2_config


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("ppo_ref") / "base"
    save_tiny_model(path, tiny_qwen2_config(), seed=5)
    return path


def _state(model_dir, *, critic=False):
    opt = ff.OptimizerConfig(lr=1e-3, max_grad_norm=None)
    cfg = ff.EngineConfig(model_path=str(model_dir), dtype="float32", optimizer=opt,
                          is_critic=critic)
    return ff.shard_model(cfg, ff.build_mesh(ff.ParallelStrategy(), device_type="cpu"))


def _aggregate(x, mask, agg):
    m = mask.double()
    if agg == "token-mean":
        return (x * m).sum() / m.sum()
    rows = m.sum(-1) > 0  # the seq-mean modes average over rows with a loss token
    per_row = (x * m).sum(-1)
    if agg == "seq-mean-token-mean":
        per_row = per_row / m.sum(-1).clamp(min=1)
    return per_row[rows].mean()


def _token_mean(x, mask):
    return float((x * mask.double()).sum() / mask.double().sum())


def _kl(logp, ref, kind):
    d = logp - ref
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d * d
    if kind == "abs":
        return d.abs()
    return (torch.exp(-d) + d - 1).clamp(-10, 10)  # k3: exp(ref − logp) − (ref − logp) − 1


def _ppo_batch(state):
    batch = random_batch(6, 14, seed=3, min_len=7, prompt_len=3)
    batch[K.LOSS_MASK][5] = False  # a row with nothing to train
    logp = ff.forward_logp(state, batch)[K.LOGP]
    g = torch.Generator().manual_seed(9)
    lm, zero = batch[K.LOSS_MASK], torch.zeros(())
    # ratios exp(logp − old) spread over about [0.45, 2.2]: past both bounds either way, and
    # past the dual clip's c for some tokens with A < 0
    batch[K.OLD_LOGP] = torch.where(lm, logp + (torch.rand(lm.shape, generator=g) - 0.5) * 1.6,
                                    zero)
    batch[K.REF_LOGP] = torch.where(lm, logp + (torch.rand(lm.shape, generator=g) - 0.5), zero)
    batch[K.ADVANTAGES] = torch.where(lm, torch.randn(lm.shape, generator=g), zero)
    return batch


PPO_CASES = [
    dict(clip_low=0.2, clip_high=0.28, dual_clip=1.5, entropy_coef=0.05, kl_coef=0.3,
         kl_kind="k3", agg="token-mean"),
    dict(clip_low=0.1, clip_high=None, dual_clip=None, entropy_coef=0.2, kl_coef=0.5,
         kl_kind="k1", agg="seq-mean-token-mean"),
    dict(clip_low=0.25, clip_high=0.4, dual_clip=1.4, entropy_coef=0.0, kl_coef=0.7,
         kl_kind="k2", agg="seq-mean-token-sum"),
    dict(clip_low=0.15, clip_high=0.3, dual_clip=None, entropy_coef=0.1, kl_coef=0.0,
         kl_kind="abs", agg="token-mean", temperature=0.8),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("opts", PPO_CASES, ids=[c["agg"] + "-" + c["kl_kind"] for c in PPO_CASES])
def test_ppo_step_loss_stats_and_gradient_equal_the_float64_reference(model_dir, opts):
    from transformers import AutoModelForCausalLM

    state = _state(model_dir)
    batch = _ppo_batch(state)
    config = ff.PPOConfig(use_behav_logp=False, **opts)
    ref = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float64,
                                               attn_implementation="eager")
    ref.eval()

    ids, mask = batch[K.INPUT_IDS], batch[K.LOSS_MASK]
    logits = ref(input_ids=ids, attention_mask=batch[K.ATTENTION_MASK].long()).logits
    dist = torch.log_softmax(logits[:, :-1] / config.temperature, -1)
    logp = torch.zeros(ids.shape, dtype=torch.float64)
    logp[:, 1:] = dist.gather(-1, ids[:, 1:, None])[..., 0]
    entropy = torch.zeros(ids.shape, dtype=torch.float64)
    entropy[:, 1:] = -(dist.exp() * dist).sum(-1)
    old, adv = batch[K.OLD_LOGP].double(), batch[K.ADVANTAGES].double()
    r = torch.exp(logp - old)
    high = config.clip_low if config.clip_high is None else config.clip_high
    pg = torch.maximum(-adv * r, -adv * r.clamp(1 - config.clip_low, 1 + high))
    if config.dual_clip is not None:
        pg = torch.where(adv < 0, torch.minimum(pg, config.dual_clip * adv.abs()), pg)
    kl_tok = _kl(logp, batch[K.REF_LOGP].double(), config.kl_kind)
    pg_loss = _aggregate(pg, mask, config.agg)
    loss = (pg_loss - config.entropy_coef * _aggregate(entropy, mask, config.agg)
            + config.kl_coef * _aggregate(kl_tok, mask, config.agg))
    loss.backward()
    grad_norm = math.sqrt(sum(float(p.grad.square().sum()) for p in ref.parameters()))
    loss, pg_loss, r = loss.item(), pg_loss.item(), r.detach()

    _, stats = ff.ppo_step(state, batch, config)
    clipped = (r < 1 - config.clip_low) | (r > 1 + high)
    assert 0.1 < _token_mean(clipped, mask) < 0.97  # the bounds are in play, not everywhere
    if config.dual_clip is not None:  # and the dual clip's cap
        assert _token_mean((adv < 0) & (r > config.dual_clip), mask) > 0.02
    assert math.isclose(float(stats["loss"]), loss, rel_tol=2e-5, abs_tol=1e-6)
    assert math.isclose(float(stats["pg_loss"]), pg_loss, rel_tol=2e-5, abs_tol=1e-6)
    assert math.isclose(float(stats["grad_norm"]), grad_norm, rel_tol=1e-4)
    if config.entropy_coef > 0:
        assert math.isclose(float(stats["entropy"]), _token_mean(entropy.detach(), mask),
                            rel_tol=1e-5)
    if config.kl_coef > 0:
        assert math.isclose(float(stats["kl"]), _token_mean(kl_tok.detach(), mask),
                            rel_tol=1e-5, abs_tol=1e-7)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("value_clip, agg", [(0.2, "token-mean"), (0.05, "seq-mean-token-sum"),
                                             (None, "seq-mean-token-mean")])
def test_critic_step_loss_equals_the_float64_value_loss(model_dir, value_clip, agg):
    state = _state(model_dir, critic=True)
    batch = random_batch(6, 14, seed=4, min_len=7, prompt_len=3)
    values = ff.compute_values(state, batch)[K.VALUES]
    g = torch.Generator().manual_seed(2)
    lm, zero = batch[K.LOSS_MASK], torch.zeros(())
    batch[K.OLD_VALUES] = torch.where(lm, values + (torch.rand(lm.shape, generator=g) - 0.5) * 0.6,
                                      zero)
    batch[K.RETURNS] = torch.where(lm, torch.randn(lm.shape, generator=g), zero)
    v, old, ret = values.double(), batch[K.OLD_VALUES].double(), batch[K.RETURNS].double()
    unclipped = (v - ret) ** 2
    if value_clip is None:
        per_token = 0.5 * unclipped
    else:
        clipped = (torch.maximum(torch.minimum(v, old + value_clip), old - value_clip) - ret) ** 2
        per_token = 0.5 * torch.maximum(unclipped, clipped)
        share = _token_mean((clipped > unclipped) & ((v - old).abs() > value_clip), lm)
        assert share > 0.1  # the clip is in play
    config = ff.CriticConfig(value_clip=value_clip, agg=agg)
    _, stats = ff.critic_step(state, batch, config)
    want = _aggregate(per_token, lm, agg)
    assert math.isclose(float(stats["loss"]), float(want), rel_tol=2e-5, abs_tol=1e-6)
