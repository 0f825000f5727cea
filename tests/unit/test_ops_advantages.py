"""fsdpfn.ops advantages and reward shaping against float64 references written with loops.

Tolerances: float32 ops vs float64 loops on the same inputs. GAE sums at most T <= 12 terms of O(1)
values, group statistics at most 8: relative error ~1e-6, so rtol=1e-5, atol=1e-5 (atol covers
outputs near 0, and division by a std that can be ~0.1).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdpfn.errors import BatchError, ConfigError
from fsdpfn.ops import (gae, group_advantages, kl, kl_in_reward, outcome_to_token_rewards, scale_rewards,
                        whiten)

SETTINGS = settings(max_examples=30, deadline=None, derandomize=True, database=None)
RTOL, ATOL = 1e-5, 1e-5


def close(actual, expected, *, rtol=RTOL, atol=ATOL, what=""):
    torch.testing.assert_close(torch.as_tensor(actual).double(), torch.as_tensor(expected).double(),
                               rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def poison(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    junk = torch.tensor([float("nan"), float("inf"), float("-inf"), 1e30])
    return torch.where(mask, x, junk[torch.arange(x.numel()) % 4].reshape(x.shape).to(x.dtype))


shapes = st.tuples(st.lists(st.integers(1, 3), min_size=1, max_size=2), st.integers(0, 12))


# --------------------------------------------------------------------------------------------
# GAE
# --------------------------------------------------------------------------------------------

def ref_gae(rewards, values, mask, gamma, lam):
    """Per row: walk the masked positions backwards; float64 lists."""
    rows_a, rows_r = [], []
    for r, v, m in zip(rewards.double().tolist(), values.double().tolist(), mask.tolist()):
        adv, ret = [0.0] * len(r), [0.0] * len(r)
        idx = [t for t in range(len(r)) if m[t]]
        next_v = next_a = 0.0
        for t in reversed(idx):
            delta = r[t] + gamma * next_v - v[t]
            next_a = delta + gamma * lam * next_a
            next_v = v[t]
            adv[t], ret[t] = next_a, next_a + v[t]
        rows_a.append(adv)
        rows_r.append(ret)
    return torch.tensor(rows_a, dtype=torch.float64), torch.tensor(rows_r, dtype=torch.float64)


@SETTINGS
@given(shape=shapes, gamma=st.sampled_from([1.0, 0.99, 0.5]), lam=st.sampled_from([1.0, 0.95, 0.0]),
       keep=st.sampled_from([0.3, 0.8, 1.0]), seed=st.integers(0, 2**16))
def test_gae_matches_naive_loop_and_ignores_masked_values(shape, gamma, lam, keep, seed):
    lead, t = shape
    rows = math.prod(lead)
    torch.manual_seed(seed)
    rewards, values = torch.randn(*lead, t), torch.randn(*lead, t)
    mask = torch.rand(*lead, t) < keep
    adv, ret = gae(rewards, values, mask, gamma=gamma, lam=lam)
    assert adv.shape == ret.shape == mask.shape and adv.dtype == ret.dtype == torch.float32
    ref_a, ref_r = ref_gae(rewards.reshape(rows, t), values.reshape(rows, t), mask.reshape(rows, t), gamma, lam)
    close(adv.reshape(rows, t), ref_a, what="advantages")
    close(ret.reshape(rows, t), ref_r, what="returns")
    adv2, ret2 = gae(poison(rewards, mask), poison(values, mask), mask, gamma=gamma, lam=lam)
    assert torch.equal(adv, adv2) and torch.equal(ret, ret2)


def test_gae_gradient_ignores_masked_values():
    torch.manual_seed(0)
    mask = torch.tensor([[True, False, True, True, False]])
    values = poison(torch.randn(1, 5), mask).requires_grad_()
    adv, ret = gae(torch.randn(1, 5), values, mask, gamma=0.9, lam=0.8)
    (adv.sum() + ret.sum()).backward()
    assert torch.isfinite(values.grad).all() and not values.grad[~mask].any()


def test_gae_bad_arguments():
    x, m = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ConfigError, match=r"gamma.*1\.5"):
        gae(x, x, m, gamma=1.5)
    with pytest.raises(ConfigError, match=r"lam.*-0\.1"):
        gae(x, x, m, lam=-0.1)
    with pytest.raises(BatchError, match="values"):
        gae(x, torch.zeros(2, 4), m)


# --------------------------------------------------------------------------------------------
# group advantages
# --------------------------------------------------------------------------------------------

def ref_group(rewards, g, norm_std, loo, eps):
    out = []
    r = rewards.double().tolist()
    for k in range(0, len(r), g):
        grp = r[k:k + g]
        mean = sum(grp) / g
        std = math.sqrt(sum((x - mean) ** 2 for x in grp) / (g - 1)) if g > 1 else 0.0
        for i, x in enumerate(grp):
            base = (sum(grp) - x) / (g - 1) if loo else mean
            a = x - base
            out.append(a / (std + eps) if norm_std else a)
    return torch.tensor(out, dtype=torch.float64)


@SETTINGS
@given(n_groups=st.integers(0, 4), g=st.integers(1, 8), norm_std=st.booleans(), loo=st.booleans(),
       binary=st.booleans(), seed=st.integers(0, 2**16))
def test_group_advantages_match_reference_and_have_zero_group_mean(n_groups, g, norm_std, loo, binary, seed):
    if loo and g == 1:
        g = 2
    torch.manual_seed(seed)
    # binary rewards (pass/fail) give groups with std 0, where only eps keeps the division finite
    rewards = (torch.rand(n_groups * g) < 0.5).float() if binary else torch.randn(n_groups * g)
    adv = group_advantages(rewards, g, norm_std=norm_std, leave_one_out=loo)
    assert adv.shape == rewards.shape and adv.dtype == torch.float32
    ref = ref_group(rewards, g, norm_std, loo, 1e-6)
    # with std 0 the centred reward is exactly 0 in both, so a ~1e6 divisor needs no wider atol
    close(adv, ref, what="advantages")
    if n_groups:
        # zero mean within each group, leave-one-out included: sum_i (G r_i - S) / (G - 1) = 0
        scale = ref.abs().reshape(n_groups, g).amax(-1).clamp(min=1.0)
        assert (adv.double().reshape(n_groups, g).sum(-1).abs() <= 1e-5 * g * scale).all()


@pytest.mark.parametrize("loo", [False, True])
@pytest.mark.parametrize("g", [2, 3, 5, 7, 8])
@pytest.mark.parametrize("value", [0.7, 0.1, 1 / 3, -2.3, 1e3 + 0.1])
def test_a_group_of_equal_rewards_has_advantage_zero(value, g, loo):
    # the mean of equal rewards is the reward: any rounding residue of the centring, divided by
    # std 0 + eps = 1e-6, would be a same-signed push of up to 0.06 on every row of the group
    rewards = torch.full((3 * g,), value)
    for norm_std in (True, False):
        adv = group_advantages(rewards, g, norm_std=norm_std, leave_one_out=loo)
        assert torch.equal(adv, torch.zeros_like(adv)), (norm_std, adv)


def test_group_advantages_group_size_one_gives_zero():
    rewards = torch.tensor([1.0, -2.0, 3.0])
    assert torch.equal(group_advantages(rewards, 1), torch.zeros(3))
    assert torch.equal(group_advantages(rewards, 1, norm_std=False), torch.zeros(3))


def test_group_advantages_bad_arguments():
    with pytest.raises(BatchError, match=r"rewards.*divisible.*B = 5.*group_size = 2"):
        group_advantages(torch.zeros(5), 2)
    with pytest.raises(ConfigError, match=r"group_size.*leave_one_out.*1"):
        group_advantages(torch.zeros(4), 1, leave_one_out=True)
    with pytest.raises(ConfigError, match=r"group_size.*0"):
        group_advantages(torch.zeros(4), 0)
    with pytest.raises(BatchError, match=r"rewards must be \[\.\.\., B\].*shape \(\)"):
        group_advantages(torch.tensor(1.0), 1)
    with pytest.raises(BatchError, match=r"rewards.*shape \(2, 3\).*B = 3.*group_size = 2"):
        group_advantages(torch.zeros(2, 3), 2)


@pytest.mark.parametrize("lead", [(3,), (2, 2)])
@pytest.mark.parametrize("norm_std,loo,ids", [(True, False, False), (False, True, False),
                                              (True, True, True)])
def test_group_advantages_on_leading_shapes_equal_each_row_alone(lead, norm_std, loo, ids):
    """fsdpfn.ops work on any leading shape: rewards[..., B] are independent batches of B rows,
    each grouped along the last dimension (by consecutive rows, or by group_ids [B])."""
    g, B = 3, 9
    rewards = torch.randn(*lead, B, generator=torch.Generator().manual_seed(4))
    group_ids = torch.tensor([2, 7, 2, 5, 7, 5, 2, 5, 7]) if ids else None
    adv = group_advantages(rewards, g, norm_std=norm_std, leave_one_out=loo, group_ids=group_ids)
    assert adv.shape == rewards.shape and adv.dtype == torch.float32
    for index in torch.cartesian_prod(*[torch.arange(n) for n in lead]).reshape(-1, len(lead)):
        row = rewards[tuple(index.tolist())]
        ref = (ref_group_by_ids(row, group_ids, norm_std, loo, 1e-6) if ids else
               ref_group(row, g, norm_std, loo, 1e-6))
        close(adv[tuple(index.tolist())], ref, what=f"advantages of batch {index.tolist()}")


# --------------------------------------------------------------------------------------------
# whitening, scaling, token rewards
# --------------------------------------------------------------------------------------------

@SETTINGS
@given(shape=shapes, shift_mean=st.booleans(), seed=st.integers(0, 2**16))
def test_whiten_matches_reference(shape, shift_mean, seed):
    lead, t = shape
    torch.manual_seed(seed)
    x = torch.randn(*lead, t) * 3 + 1
    mask = torch.rand(*lead, t) < 0.7
    out = whiten(x, mask, shift_mean=shift_mean)
    vals = x.double()[mask].tolist()
    n = len(vals)
    mean = sum(vals) / max(n, 1)
    var = sum((v - mean) ** 2 for v in vals) / (n - 1) if n > 1 else 0.0
    ref = torch.where(mask, (x.double() - mean) / math.sqrt(var + 1e-8) + (0.0 if shift_mean else mean), 0.0)
    # n = 1: var 0, the single centred value is 0 in both
    close(out, ref, what="whiten")
    assert torch.equal(out, whiten(poison(x, mask), mask, shift_mean=shift_mean))


def test_scale_rewards():
    r = torch.tensor([-3.0, 0.5, 4.0])
    close(scale_rewards(r, scale=2.0, bias=1.0), [-5.0, 2.0, 9.0])
    close(scale_rewards(r, scale=2.0, bias=1.0, clip=3.0), [-3.0, 2.0, 3.0])
    with pytest.raises(ConfigError, match=r"clip.*0"):
        scale_rewards(r, clip=0.0)


@SETTINGS
@given(shape=shapes, seed=st.integers(0, 2**16))
def test_outcome_to_token_rewards_places_reward_at_last_masked_token(shape, seed):
    lead, t = shape
    rows = math.prod(lead)
    torch.manual_seed(seed)
    rewards = torch.randn(*lead).requires_grad_()
    mask = torch.rand(*lead, t) < 0.5
    out = outcome_to_token_rewards(rewards, mask)
    assert out.shape == mask.shape
    for r, row, m in zip(rewards.detach().reshape(-1).tolist(), out.reshape(rows, t).tolist(),
                         mask.reshape(rows, t).tolist()):
        last = max((i for i in range(t) if m[i]), default=None)
        assert row == [r if i == last else 0.0 for i in range(t)]
    out.sum().backward()
    assert torch.equal(rewards.grad, mask.any(-1).float())


@SETTINGS
@given(shape=shapes, kind=st.sampled_from(["k1", "k2", "k3", "abs"]), with_tokens=st.booleans(),
       seed=st.integers(0, 2**16))
def test_kl_in_reward(shape, kind, with_tokens, seed):
    lead, t = shape
    torch.manual_seed(seed)
    rewards = torch.randn(*lead)
    token_rewards = torch.randn(*lead, t) if with_tokens else None
    logp, ref_logp = -torch.rand(*lead, t) * 3, -torch.rand(*lead, t) * 3
    mask = torch.rand(*lead, t) < 0.6
    out = kl_in_reward(token_rewards, rewards, logp, ref_logp, mask, coef=0.05, kind=kind)
    expected = outcome_to_token_rewards(rewards, mask).double() - 0.05 * kl(logp, ref_logp, kind).double()
    if with_tokens:
        expected = expected + token_rewards.double()
    expected = torch.where(mask, expected, 0.0)
    close(out, expected)
    poisoned = kl_in_reward(None if token_rewards is None else poison(token_rewards, mask), rewards,
                            poison(logp, mask), poison(ref_logp, mask), mask, coef=0.05, kind=kind)
    assert torch.equal(out, poisoned)
    with pytest.raises(ConfigError, match="kind"):
        kl_in_reward(None, rewards, logp, ref_logp, mask, coef=0.1, kind="k5")


# --------------------------------------------------------------------------------------------
# groups given by ids, whitening over several parts, compute_advantages
# --------------------------------------------------------------------------------------------

def ref_group_by_ids(rewards, ids, norm_std, loo, eps):
    """float64: each row against the other rows with its id, wherever they are."""
    r, ids = rewards.double().tolist(), ids.tolist()
    out = []
    for x, i in zip(r, ids):
        grp = [y for y, j in zip(r, ids) if j == i]
        g = len(grp)
        mean = sum(grp) / g
        std = math.sqrt(sum((y - mean) ** 2 for y in grp) / (g - 1)) if g > 1 else 0.0
        a = x - ((sum(grp) - x) / (g - 1) if loo else mean)
        out.append(a / (std + eps) if norm_std else a)
    return torch.tensor(out, dtype=torch.float64)


@SETTINGS
@given(n_groups=st.integers(1, 4), g=st.integers(2, 5), norm_std=st.booleans(), loo=st.booleans(),
       data=st.data())
def test_group_advantages_by_ids_match_reference_in_any_row_order(n_groups, g, norm_std, loo, data):
    ids = torch.tensor(data.draw(st.permutations([5 * k - 3 for k in range(n_groups)] * g)))
    rewards = torch.tensor(data.draw(st.lists(st.floats(-3, 3), min_size=len(ids),
                                              max_size=len(ids))))
    adv = group_advantages(rewards, g, norm_std=norm_std, leave_one_out=loo, group_ids=ids)
    close(adv, ref_group_by_ids(rewards, ids, norm_std, loo, 1e-6), what="advantages by ids")
    with pytest.raises(BatchError, match=r"group_ids: every group must have group_size=2 rows, "
                                         r"got 3 rows with id 0"):
        group_advantages(torch.zeros(6), 2, group_ids=torch.tensor([0, 0, 0, 1, 1, 1]))


@SETTINGS
@given(shape=shapes, parts=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_whiten_with_all_reduce_uses_the_statistics_of_all_parts(shape, parts, seed):
    """`parts` ranks holding identical rows: summing over them must give the statistics of the
    concatenated batch (n = parts·n, so the unbiased variance changes), and each part is
    whitened with those."""
    lead, t = shape
    torch.manual_seed(seed)
    x, mask = torch.randn(*lead, t) * 2 + 1, torch.rand(*lead, t) < 0.7
    out = whiten(x, mask, all_reduce=lambda s: s * parts)
    whole = whiten(torch.cat([x] * parts), torch.cat([mask] * parts))
    close(out, whole[: x.shape[0]], what="whiten over parts")


def _adv_batch(B, T, G, seed):
    from fsdpfn import keys as K
    from fsdpfn.testing import random_batch
    batch = random_batch(B, T, seed=seed, group_size=G)
    g = torch.Generator().manual_seed(seed)
    batch.set(K.VALUES, torch.where(batch[K.ATTENTION_MASK], torch.randn(B, T, generator=g), 0.0))
    batch.set(K.OLD_LOGP, torch.where(batch[K.ATTENTION_MASK], -torch.rand(B, T, generator=g), 0.0))
    batch.set(K.REF_LOGP, torch.where(batch[K.ATTENTION_MASK], -torch.rand(B, T, generator=g), 0.0))
    return batch


ESTIMATORS = ["grpo", "drgrpo", "rloo", "reinforce++", "gae"]


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_compute_advantages_returns_separate_advantages_and_returns(estimator):
    from fsdpfn import AdvantageConfig, compute_advantages, keys as K
    batch = _adv_batch(8, 6, 4, seed=1)
    out = compute_advantages(batch, AdvantageConfig(estimator=estimator, group_size=4,
                                                    kl_coef=0.1))
    adv, ret = out[K.ADVANTAGES], out[K.RETURNS]
    assert adv.data_ptr() != ret.data_ptr()
    before = ret.clone()
    adv.add_(1.0)
    assert torch.equal(ret, before)


@SETTINGS
@given(estimator=st.sampled_from(["grpo", "drgrpo", "rloo"]), whiten_=st.booleans(), data=st.data())
def test_compute_advantages_with_group_id_is_row_order_equivariant(estimator, whiten_, data):
    """Rows permuted with their group_id give the same advantages, permuted: groups are the ids,
    not the positions."""
    from fsdpfn import AdvantageConfig, compute_advantages, keys as K
    G = data.draw(st.integers(2, 4))
    n = data.draw(st.integers(1, 3))
    batch = _adv_batch(n * G, 5, G, seed=data.draw(st.integers(0, 2**16)))
    config = AdvantageConfig(estimator=estimator, group_size=G, whiten=whiten_)
    plain = compute_advantages(batch, config)[K.ADVANTAGES]
    perm = torch.tensor(data.draw(st.permutations(range(n * G))))
    ids = torch.arange(n).repeat_interleave(G) * 11
    shuffled = batch.clone().set(K.GROUP_ID, ids)[perm]
    close(compute_advantages(shuffled, config)[K.ADVANTAGES], plain[perm], what="permuted")


def test_compute_advantages_refuses_split_groups():
    from fsdpfn import AdvantageConfig, compute_advantages, keys as K
    batch = _adv_batch(8, 6, 4, seed=2)
    piece = batch[torch.tensor([0, 2, 4, 6])].set(K.ROW_INDEX, torch.tensor([0, 2, 4, 6]))
    for estimator in ("grpo", "drgrpo", "rloo"):
        with pytest.raises(BatchError, match="shard_batch split the groups"):
            compute_advantages(piece, AdvantageConfig(estimator=estimator, group_size=4))
    ids = piece.clone().set(K.GROUP_ID, torch.tensor([0, 0, 1, 1]))
    with pytest.raises(BatchError, match="group_id: every group must have group_size=4"):
        compute_advantages(ids, AdvantageConfig(group_size=4))
    # token-level estimators have no groups: a sharded batch is fine
    compute_advantages(piece, AdvantageConfig(estimator="reinforce++"))


@pytest.mark.parametrize("eps", [-1.0, float("inf"), float("nan")])
def test_group_advantages_refuses_an_eps_that_is_not_finite_and_non_negative(eps):
    # a negative eps could cancel the std (a division by ~0) or flip the advantages' sign
    with pytest.raises(ConfigError, match="eps must be a finite number >= 0"):
        group_advantages(torch.tensor([1.0, 2.0, 4.0]), 3, eps=eps)
