"""Settings whose float32 arithmetic leaves float32's range are refused by name, not computed
into NaN: a temperature below 1e-6 (the servers sample greedily below it, and logits / T of
T = 1e-300 is a division by float32's 0), reward settings past float32's largest value, and
rewards whose advantages overflow it."""

import math

import pytest
import torch

import fsdpfn as ff
from fsdpfn import keys as K
from fsdpfn.app.recipes.rollout_config import RolloutConfig
from fsdpfn.ops import chunked_logprobs, token_entropy, token_logprobs
from fsdpfn.testing.batches import random_batch, with_ppo_keys
from fsdpfn.testing.models import tiny_qwen2_config

TOO_COLD = [1e-300, 1e-40, 1e-7, 0.99e-6]
RULE = "temperature: must be a finite number >= 1e-06"


@pytest.fixture(scope="module")
def state():
    mesh = ff.build_mesh(ff.ParallelStrategy(), device_type="cpu")
    return ff.shard_model(ff.EngineConfig(model_config=tiny_qwen2_config().to_dict(),
                                          dtype="float32"), mesh)


@pytest.mark.parametrize("t", TOO_COLD)
def test_a_temperature_below_the_greedy_bound_is_refused_everywhere_it_is_taken(state, t):
    batch = random_batch(2, 8, seed=0)
    before = {k: v.clone() for k, v in batch.items()}
    with pytest.raises(ff.ConfigError, match=RULE):
        ff.forward_logp(state, batch, temperature=t)
    assert batch.keys() == before.keys() and all(torch.equal(batch[k], v)
                                                 for k, v in before.items())
    for build in (lambda: ff.PPOConfig(temperature=t),
                  lambda: ff.Objective(lambda o, m, c: (o[K.LOGP].sum(), {}), temperature=t),
                  lambda: RolloutConfig(temperature=t)):
        with pytest.raises(ff.ConfigError, match=RULE):
            build()
    logits, targets = torch.randn(3, 5), torch.zeros(3, dtype=torch.long)
    for call in (lambda: token_logprobs(logits, targets, temperature=t),
                 lambda: token_entropy(logits, temperature=t),
                 lambda: chunked_logprobs(torch.randn(3, 4), torch.randn(5, 4), targets,
                                          temperature=t)):
        with pytest.raises(ff.ConfigError, match=RULE):
            call()


def test_the_coldest_temperature_taken_gives_finite_log_probs_of_the_float64_softmax(state):
    logits = torch.randn(6, 11) * 4
    targets = torch.arange(6)
    got = token_logprobs(logits, targets, temperature=1e-6).double()
    want = torch.log_softmax(logits.double() / 1e-6, -1).gather(1, targets[:, None])[:, 0]
    assert torch.isfinite(got).all()
    # float32 holds logits / T to 24 bits: the error scales with the largest |logit| / T
    assert (got - want).abs().max() <= 4 * 2**-23 * float(logits.abs().max()) / 1e-6
    out = ff.forward_logp(state, random_batch(2, 8, seed=1), temperature=1e-6)
    assert torch.isfinite(out[K.LOGP]).all()


@pytest.mark.parametrize("field", ["reward_scale", "reward_bias", "kl_coef"])
@pytest.mark.parametrize("value", [1e39, 1e300])
def test_a_reward_setting_past_float32_is_refused_by_name(field, value):
    rule = r"must be within float32's range \(\|x\| <= 3.4e38\)"
    with pytest.raises(ff.ConfigError, match=rf"^{field}: {rule}"):
        ff.AdvantageConfig(**{field: value})
    ff.AdvantageConfig(**{field: 3.4e38})


def _batch(rewards):
    b = with_ppo_keys(random_batch(4, 12, seed=0))
    b[K.REWARDS] = torch.tensor(rewards, dtype=torch.float32)
    b[K.GROUP_ID] = torch.tensor([0, 0, 1, 1])
    b[K.VALUES] = torch.zeros(4, 12)
    return b


@pytest.mark.parametrize("estimator", ["grpo", "drgrpo", "rloo", "reinforce++", "gae"])
def test_advantages_that_overflow_float32_are_a_batch_error_naming_where(estimator):
    batch = _batch([3e38, -3e38, 1.0, 2.0])
    before = {k: v.clone() for k, v in batch.items()}
    config = ff.AdvantageConfig(estimator=estimator, group_size=2, reward_scale=10.0)
    with pytest.raises(ff.BatchError) as info:
        ff.compute_advantages(batch, config)
    msg = str(info.value)
    assert msg.split(":")[0] in ("advantages", "returns"), msg
    row = int(msg.split("at row ")[1].split(",")[0])
    assert row in (0, 1) and "reward_scale=10.0" in msg and "overflow float32" in msg, msg
    assert batch.keys() == before.keys() and all(torch.equal(batch[k], v)
                                                 for k, v in before.items())
    # the same rewards at a scale float32 holds: finite advantages, as a float64 reference has
    ok = ff.compute_advantages(batch, ff.AdvantageConfig(estimator=estimator, group_size=2,
                                                         reward_scale=1e-30))
    assert torch.isfinite(ok[K.ADVANTAGES]).all() and torch.isfinite(ok[K.RETURNS]).all()
    if estimator == "grpo":  # group 0's rewards 3e8 and -3e8: advantages +-1/sqrt(2)
        mask = batch[K.LOSS_MASK]
        want = [1 / math.sqrt(2), -1 / math.sqrt(2)]
        for row in (0, 1):
            got = ok[K.ADVANTAGES][row][mask[row]].double()
            assert torch.allclose(got, torch.full_like(got, want[row]), rtol=1e-5), got


def test_the_server_and_the_trainer_hold_one_temperature_floor_and_one_seed_range():
    """The server imports nothing of the trainer, so it spells both bounds itself."""
    from fsdpfn.rollout.errors import GREEDY_BELOW, SEED_END as SERVER_SEED_END
    from fsdpfn.validators import SEED_END, TEMPERATURE_MIN

    assert GREEDY_BELOW == TEMPERATURE_MIN == 1e-6
    assert SERVER_SEED_END == SEED_END == 2**63
