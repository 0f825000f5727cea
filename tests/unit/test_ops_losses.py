"""fsdpfn.ops kl, aggregation and losses against float64 references written with loops.

Tolerances: the ops compute in float32, the references in float64 from the same float32 inputs.
Ratios exp(logp - old_logp) here stay below ~e^3, so float32 rounding of the exp and of a sum of
<= 100 terms keeps relative errors around 1e-6; we use rtol=1e-5, atol=1e-6.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdpfn.config import PPOConfig
from fsdpfn.errors import BatchError, ConfigError
from fsdpfn.ops import (aggregate, aggregate_sum, aggregate_sum_packed, bradley_terry_loss,
                        bradley_terry_loss_sum, bradley_terry_loss_with_stats, dpo_loss,
                        dpo_loss_sum, dpo_loss_with_stats, kl, policy_loss, policy_loss_terms,
                        sft_loss, sft_loss_sum, sft_loss_with_stats, value_loss, value_loss_terms,
                        value_loss_with_stats)
from fsdpfn.ops import gae

SETTINGS = settings(max_examples=30, deadline=None, derandomize=True, database=None)
MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
RTOL, ATOL = 1e-5, 1e-6


def close(actual, expected, *, rtol=RTOL, atol=ATOL, what=""):
    torch.testing.assert_close(torch.as_tensor(actual).double(), torch.as_tensor(expected).double(),
                               rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def poison(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x with nan, +-inf and huge values wherever mask is False."""
    junk = torch.tensor([float("nan"), float("inf"), float("-inf"), 1e30, -1e30])
    fill = junk[torch.arange(x.numel()) % len(junk)].reshape(x.shape).to(x.dtype)
    return torch.where(mask, x, fill)


shapes = st.tuples(st.lists(st.integers(1, 4), min_size=1, max_size=2), st.integers(1, 9))


def draw_tokens(seed, lead, t, *, keep=0.6, spread=0.3):
    torch.manual_seed(seed)
    shape = (*lead, t)
    logp = -torch.rand(shape) * 3.0
    old = logp + torch.randn(shape) * spread
    behav = old + torch.randn(shape) * spread
    adv = torch.randn(shape)
    mask = torch.rand(shape) < keep
    return logp, old, behav, adv, mask


# --------------------------------------------------------------------------------------------
# kl
# --------------------------------------------------------------------------------------------

def ref_kl(lp, ref, kind):
    d = lp - ref
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d * d
    if kind == "abs":
        return abs(d)
    return min(max(math.exp(-d) + d - 1.0, -10.0), 10.0)


@SETTINGS
@given(kind=st.sampled_from(["k1", "k2", "k3", "abs"]), shape=shapes, spread=st.sampled_from([0.1, 1.0, 30.0]),
       seed=st.integers(0, 2**16))
def test_kl_matches_reference_and_has_finite_grads(kind, shape, spread, seed):
    torch.manual_seed(seed)
    lead, t = shape
    lp = (torch.randn(*lead, t) * spread).requires_grad_()
    ref = torch.randn(*lead, t) * spread
    out = kl(lp, ref, kind)
    expected = torch.tensor([ref_kl(a, b, kind) for a, b in zip(lp.double().flatten().tolist(),
                                                                  ref.double().flatten().tolist())],
                            dtype=torch.float64).reshape(out.shape)
    close(out, expected, rtol=1e-5, atol=1e-5, what=kind)
    out.sum().backward()
    assert torch.isfinite(lp.grad).all()  # k3 clamps: exp overflow must not give inf * 0 = nan


def test_kl_unknown_kind_names_kind_allowed_and_value():
    with pytest.raises(ConfigError, match=r"kind.*k1.*k2.*k3.*abs.*'k4'"):
        kl(torch.zeros(2), torch.zeros(2), "k4")


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "abs"])
def test_kl_of_different_shapes_is_a_batch_error_naming_both(kind):
    """No broadcasting: [2, 3] against [2, 4] (or [1, 3], which torch would broadcast)."""
    for ref_shape in [(2, 4), (1, 3)]:
        with pytest.raises(BatchError) as info:
            kl(torch.zeros(2, 3), torch.zeros(*ref_shape), kind)
        assert str(info.value) == (f"ref_logp must have the shape of logp (2, 3), got "
                                   f"{ref_shape}")


# --------------------------------------------------------------------------------------------
# aggregation
# --------------------------------------------------------------------------------------------

def ref_aggregate(x, mask, mode):
    """Loops over rows [R, T] in float64 (autograd flows through x); 0 when nothing is masked in.

    Returns (value, normaliser count)."""
    x2, m2 = x.double().reshape(-1, x.shape[-1]), mask.reshape(-1, mask.shape[-1])
    zero = torch.zeros((), dtype=torch.float64)
    rows = [[x2[r, t] for t in range(x2.shape[1]) if m2[r, t]] for r in range(x2.shape[0])]
    if mode == "token-mean":
        vals = [v for row in rows for v in row]
        return sum(vals, zero) / max(len(vals), 1), len(vals)
    per_row = [sum(row, zero) if mode == "seq-mean-token-sum" else sum(row, zero) / len(row)
               for row in rows if row]
    return sum(per_row, zero) / max(len(per_row), 1), len(per_row)


@SETTINGS
@given(mode=st.sampled_from(MODES), shape=shapes, keep=st.sampled_from([0.0, 0.3, 1.0]),
       seed=st.integers(0, 2**16))
def test_aggregate_matches_reference_and_ignores_masked_values(mode, shape, keep, seed):
    lead, t = shape
    _, _, _, x, mask = draw_tokens(seed, lead, t, keep=keep)
    x.requires_grad_()
    out = aggregate(x, mask, mode)
    num, den = aggregate_sum(x, mask, mode)
    expected, count = ref_aggregate(x.detach(), mask, mode)
    close(out, expected, what=mode)
    assert float(den) == count and num.dtype == den.dtype == torch.float32
    close(num / max(float(den), 1.0), expected)
    out.backward()
    # poisoned values under the mask: identical value and gradient, zero gradient there
    x2 = poison(x.detach(), mask).requires_grad_()
    out2 = aggregate(x2, mask, mode)
    out2.backward()
    assert torch.equal(out, out2)
    assert torch.equal(x.grad, x2.grad)
    assert not x2.grad[~mask].any()


@SETTINGS
@given(mode=st.sampled_from(MODES), n_rows=st.integers(1, 8), t=st.integers(1, 7), split=st.integers(1, 7),
       seed=st.integers(0, 2**16))
def test_aggregate_sum_is_additive_over_micro_batches(mode, n_rows, t, split, seed):
    _, _, _, x, mask = draw_tokens(seed, [n_rows], t)
    split = min(split, n_rows)
    parts = [aggregate_sum(x[i:i + split], mask[i:i + split], mode) for i in range(0, n_rows, split)]
    num = sum(p[0] for p in parts)
    den = sum(p[1] for p in parts)
    close(num / den.clamp(min=1), aggregate(x, mask, mode), what="micro-batched")


@SETTINGS
@given(mode=st.sampled_from(MODES), lengths=st.lists(st.integers(0, 6), min_size=1, max_size=5),
       seed=st.integers(0, 2**16))
def test_aggregate_sum_packed_equals_padded(mode, lengths, seed):
    torch.manual_seed(seed)
    t = max(max(lengths), 1)
    x, mask = torch.randn(len(lengths), t), torch.rand(len(lengths), t) < 0.7
    real = torch.arange(t) < torch.tensor(lengths).unsqueeze(-1)  # right padding
    packed_x, packed_m = x[real], mask[real]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    num, den = aggregate_sum_packed(packed_x, packed_m, cu, mode)
    num_ref, den_ref = aggregate_sum(x, mask & real, mode)
    close(num, num_ref)
    assert float(den) == float(den_ref)


def test_aggregate_empty_mask_is_zero_not_nan():
    for mode in MODES:
        x = torch.full((2, 3), float("nan"))
        assert float(aggregate(x, torch.zeros(2, 3, dtype=torch.bool), mode)) == 0.0
        num, den = aggregate_sum(x, torch.zeros(2, 3, dtype=torch.bool), mode)
        assert float(num) == 0.0 and float(den) == 0.0


def test_aggregate_bad_arguments():
    with pytest.raises(ConfigError, match=r"mode.*token-mean.*seq-mean-token-sum.*'token-sum'"):
        aggregate(torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool), "token-sum")
    with pytest.raises(BatchError, match="mask"):
        aggregate(torch.zeros(2, 3), torch.ones(2, 4, dtype=torch.bool), "token-mean")
    with pytest.raises(BatchError, match="cu_seqlens"):
        aggregate_sum_packed(torch.zeros(5), torch.ones(5, dtype=torch.bool), torch.tensor([0, 2, 4]),
                             "seq-mean-token-mean")


# --------------------------------------------------------------------------------------------
# policy loss
# --------------------------------------------------------------------------------------------

def ref_policy(logp, old, adv, mask, *, lo, hi, dual, behav, cap, level, agg):
    """Token by token in float64 (logp a float64 leaf). Returns (loss, per-token loss rows, stats)."""
    R, T = logp.shape[0], logp.shape[1]
    loss_rows, clipped, dualed, ratios, nlr, weights = [], [], [], [], [], []
    for b in range(R):
        idx = [t for t in range(T) if mask[b, t]]
        seq_lr = sum(logp[b, t] - old[b, t] for t in idx) / len(idx) if idx else None
        row = []
        for t in range(T):
            if not mask[b, t]:
                row.append(None)
                continue
            lr = seq_lr if level == "sequence" else logp[b, t] - old[b, t]
            r = torch.exp(lr)
            a = float(adv[b, t])
            pg1 = -a * r
            pg2 = -a * torch.clamp(r, 1 - lo, 1 + (lo if hi is None else hi))
            is_clipped = float(pg2.detach()) > float(pg1.detach())
            pg = pg2 if is_clipped else pg1
            is_dual = dual is not None and a < 0 and float(pg.detach()) > -a * dual
            if is_dual:
                pg = torch.tensor(-a * dual, dtype=torch.float64)
            if behav is not None:
                w = math.exp(float(old[b, t]) - float(behav[b, t]))
                w = min(w, cap) if cap is not None else w
                pg = pg * w
                weights.append(w)
            row.append(pg)
            clipped.append(is_clipped)
            dualed.append(is_dual)
            ratios.append(float(r.detach()))
            nlr.append(float(old[b, t]) - float(logp[b, t].detach()))
        loss_rows.append(row)
    # aggregation, written out per mode
    valid = [[v for v in row if v is not None] for row in loss_rows]
    valid = [v for v in valid if v]
    zero = torch.zeros((), dtype=torch.float64)
    if agg == "token-mean":
        toks = [v for row in valid for v in row]
        loss = sum(toks, zero) / max(len(toks), 1)
    elif agg == "seq-mean-token-sum":
        loss = sum((sum(row, zero) for row in valid), zero) / max(len(valid), 1)
    else:
        loss = sum((sum(row, zero) / len(row) for row in valid), zero) / max(len(valid), 1)
    n = max(len(ratios), 1)
    stats = {"clip_frac": sum(clipped) / n, "dual_clip_frac": sum(dualed) / n,
             "approx_kl": sum(nlr) / n, "ratio_mean": sum(ratios) / n,
             "ratio_max": max(ratios) if ratios else 0.0}
    if behav is not None:
        stats["behav_weight_mean"] = sum(weights) / n
        stats["behav_weight_max"] = max(weights) if weights else 0.0
    return loss, stats


policy_options = st.fixed_dictionaries({
    "clip_low": st.sampled_from([0.1, 0.2]),
    "clip_high": st.sampled_from([None, 0.28]),
    "dual_clip": st.sampled_from([None, 2.0]),
    "agg": st.sampled_from(MODES),
    "use_behav": st.booleans(),
    "behav_cap": st.sampled_from([None, 1.5]),
    "ratio_level": st.sampled_from(["token", "sequence"]),
})


@SETTINGS
@given(shape=shapes, opts=policy_options, spread=st.sampled_from([0.05, 0.5, 1.5]), seed=st.integers(0, 2**16))
def test_policy_loss_matches_reference_values_grads_stats(shape, opts, spread, seed):
    lead, t = shape
    logp, old, behav, adv, mask = draw_tokens(seed, lead, t, spread=spread)
    behav = behav if opts["use_behav"] else None
    logp.requires_grad_()
    loss, stats = policy_loss(logp, old, adv, mask, clip_low=opts["clip_low"], clip_high=opts["clip_high"],
                              dual_clip=opts["dual_clip"], agg=opts["agg"], behav_logp=behav,
                              behav_cap=opts["behav_cap"], ratio_level=opts["ratio_level"])
    loss.backward()

    flat = lambda x: None if x is None else x.detach().double().reshape(-1, t)  # noqa: E731
    lp64 = flat(logp).requires_grad_()
    ref_loss, ref_stats = ref_policy(lp64, flat(old), flat(adv), mask.reshape(-1, t), lo=opts["clip_low"],
                                     hi=opts["clip_high"], dual=opts["dual_clip"], behav=flat(behav),
                                     cap=opts["behav_cap"], level=opts["ratio_level"], agg=opts["agg"])
    close(loss, ref_loss, what="loss")
    if ref_loss.requires_grad:
        ref_loss.backward()
        close(logp.grad.reshape(-1, t), lp64.grad, what="grad logp")
    else:  # nothing masked in, or every token capped: no gradient at all
        assert not logp.grad.any()
    assert set(stats) == set(ref_stats)
    for k, v in stats.items():
        assert v.shape == () and v.dtype == torch.float32 and not v.requires_grad
        close(v, ref_stats[k], what=k)


@SETTINGS
@given(shape=shapes, agg=st.sampled_from(MODES), seed=st.integers(0, 2**16))
def test_policy_loss_at_ratio_one_is_minus_mean_advantage(shape, agg, seed):
    lead, t = shape
    logp, _, _, adv, mask = draw_tokens(seed, lead, t)
    logp.requires_grad_()
    loss, stats = policy_loss(logp, logp.detach(), adv, mask, agg=agg)
    close(loss, -ref_aggregate(adv, mask, agg)[0], what="loss")
    assert float(stats["clip_frac"]) == 0.0 and float(stats["approx_kl"]) == 0.0
    if mask.any():
        assert float(stats["ratio_mean"]) == 1.0 and float(stats["ratio_max"]) == 1.0
    loss.backward()
    # d(-A r)/d logp = -A r = -A at r = 1, times the aggregation weight of each token
    w = torch.autograd.functional.jacobian(lambda x: aggregate(x, mask, agg), adv)
    close(logp.grad, -adv * w, what="grad")


@SETTINGS
@given(shape=shapes, dual=st.sampled_from([None, 2.0]), seed=st.integers(0, 2**16))
def test_policy_loss_clipped_tokens_have_zero_gradient(shape, dual, seed):
    lead, t = shape
    logp, old, _, adv, mask = draw_tokens(seed, lead, t, spread=1.0)  # wide ratios: lots of clipping
    logp.requires_grad_()
    terms = policy_loss_terms(logp, old, adv, mask, clip_low=0.2, dual_clip=dual)
    terms.loss.sum().backward()
    capped = (terms.clipped + terms.dual_clipped) > 0
    assert not logp.grad[capped].any()
    assert not logp.grad[~mask].any()
    # unclipped masked tokens with A != 0 do get a gradient: -A r
    free = mask & ~capped
    close(logp.grad[free], -adv[free] * (logp - old).detach().exp()[free], what="unclipped grad")


@SETTINGS
@given(shape=shapes, opts=policy_options, seed=st.integers(0, 2**16))
def test_policy_loss_ignores_values_under_the_mask(shape, opts, seed):
    lead, t = shape
    logp, old, behav, adv, mask = draw_tokens(seed, lead, t)
    kwargs = dict(clip_low=opts["clip_low"], clip_high=opts["clip_high"], dual_clip=opts["dual_clip"],
                  agg=opts["agg"], behav_cap=opts["behav_cap"], ratio_level=opts["ratio_level"])
    use_behav = opts["use_behav"]
    results = []
    for transform in (lambda x: x, lambda x: poison(x, mask)):
        lp = transform(logp).detach().clone().requires_grad_()
        loss, stats = policy_loss(lp, transform(old), transform(adv), mask,
                                  behav_logp=transform(behav) if use_behav else None, **kwargs)
        loss.backward()
        results.append((loss, stats, lp.grad))
    (l1, s1, g1), (l2, s2, g2) = results
    assert torch.equal(l1, l2) and torch.equal(g1, g2)
    assert not g2[~mask].any()
    for k in s1:
        assert torch.equal(s1[k], s2[k]), k


def test_policy_loss_bad_arguments():
    x, m = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ConfigError, match=r"dual_clip.*> 1.*0\.5"):
        policy_loss(x, x, x, m, dual_clip=0.5)
    with pytest.raises(ConfigError, match=r"clip_low.*-0\.1"):
        policy_loss(x, x, x, m, clip_low=-0.1)
    with pytest.raises(ConfigError, match=r"ratio_level.*token.*sequence.*'seq'"):
        policy_loss(x, x, x, m, ratio_level="seq")
    for agg in ("mean", "token_mean"):  # named by the loss's own parameter
        with pytest.raises(ConfigError) as info:
            policy_loss(x, x, x, m, agg=agg)
        assert str(info.value) == (f"agg must be one of ['token-mean', 'seq-mean-token-sum', "
                                   f"'seq-mean-token-mean'], got {agg!r}")
        with pytest.raises(ConfigError, match=rf"^agg must be one of .*, got {agg!r}$"):
            value_loss(x, x, x, m, agg=agg)
        with pytest.raises(ConfigError, match=rf"^agg must be one of .*, got {agg!r}$"):
            sft_loss_sum(x, m, agg=agg)
    with pytest.raises(ConfigError, match=r"^mode must be one of .*, got 'mean'$"):
        aggregate(x, m, "mean")
    with pytest.raises(BatchError, match="advantages"):
        policy_loss(x, x, torch.zeros(2, 4), m)


@pytest.mark.parametrize("clip_low", [1.0, 1.5, -0.1])
def test_policy_loss_clip_low_follows_ppo_configs_rule(clip_low):
    """clip_low < 1, as PPOConfig: 1 - clip_low is the ratio's lower bound. CISPO's weight
    takes 1 (no lower bound), as PPOConfig.cispo_clip_low, and nothing above."""
    x, m = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ConfigError) as info:
        policy_loss(x, x, x, m, clip_low=clip_low)
    assert str(info.value) == f"clip_low must be in [0, 1), got {clip_low!r}"
    if clip_low == 1.0:
        policy_loss(x, x, x, m, clip_low=clip_low, kind="cispo")
    else:
        with pytest.raises(ConfigError, match=rf"^clip_low must be in \[0, 1\] with "
                                              rf"kind='cispo', got {clip_low!r}$"):
            policy_loss(x, x, x, m, clip_low=clip_low, kind="cispo")
    with pytest.raises(ConfigError, match=rf"clip_low: must be .*, got {clip_low!r}"):
        PPOConfig(clip_low=clip_low)


# --------------------------------------------------------------------------------------------
# value loss
# --------------------------------------------------------------------------------------------

@SETTINGS
@given(shape=shapes, clip=st.sampled_from([None, 0.2, 0.5]), agg=st.sampled_from(MODES),
       seed=st.integers(0, 2**16))
def test_value_loss_matches_reference_and_ignores_masked_values(shape, clip, agg, seed):
    lead, t = shape
    torch.manual_seed(seed)
    v, v_old, ret = torch.randn(*lead, t), torch.randn(*lead, t), torch.randn(*lead, t)
    mask = torch.rand(*lead, t) < 0.6
    v.requires_grad_()
    loss, stats = value_loss_with_stats(v, v_old, ret, mask, clip=clip, agg=agg)
    assert torch.equal(value_loss(v, v_old, ret, mask, clip=clip, agg=agg), loss)
    loss.backward()
    # reference: per token in float64
    v64 = v.detach().double().reshape(-1, t).requires_grad_()
    vo, r64, m2 = v_old.double().reshape(-1, t), ret.double().reshape(-1, t), mask.reshape(-1, t)
    rows, n_clip = [], 0
    for i in range(v64.shape[0]):
        row = []
        for j in range(t):
            unclipped = 0.5 * (v64[i, j] - r64[i, j]) ** 2
            if clip is not None and m2[i, j]:
                vc = torch.clamp(v64[i, j], float(vo[i, j]) - clip, float(vo[i, j]) + clip)
                clipped = 0.5 * (vc - r64[i, j]) ** 2
                use_clipped = float(clipped.detach()) > float(unclipped.detach())
                n_clip += use_clipped
                unclipped = clipped if use_clipped else unclipped
            row.append(unclipped)
        rows.append(torch.stack(row))
    ref, _ = ref_aggregate(torch.stack(rows), m2, agg)
    close(loss, ref, what="loss")
    if ref.requires_grad:
        ref.backward()
        close(v.grad.reshape(-1, t), v64.grad, what="grad")
    else:
        assert not v.grad.any()
    n = max(int(mask.sum()), 1)
    close(stats["vf_clip_frac"], n_clip / n)
    close(stats["value_mean"], v.detach()[mask].double().sum() / n)
    close(stats["returns_mean"], ret[mask].double().sum() / n)
    # poisoned masked-out values: same loss and grad
    v2 = poison(v.detach(), mask).requires_grad_()
    loss2 = value_loss(v2, poison(v_old, mask), poison(ret, mask), mask, clip=clip, agg=agg)
    loss2.backward()
    assert torch.equal(loss, loss2) and torch.equal(v.grad, v2.grad)


def test_value_loss_counts_a_token_clipped_only_where_the_clamp_acts():
    """Within old ± clip the clipped value is v itself: v_old + (v - v_old) can differ from v in
    float32's last bit, which neither counts as clipping in vf_clip_frac nor picks that branch.
    These tokens lie within 0.5 of v_old, and the sum rounds away from v for each."""
    v = torch.tensor([0.11984150856733322, 0.0008918217499740422, -0.10247437655925751])
    v_old = torch.tensor([0.5799434185028076, 0.2936166822910309, -0.5401241183280945])
    ret = torch.tensor([-1.532461166381836, -0.9904566407203674, -0.05296880006790161])
    assert (v_old + (v - v_old) != v).any()  # the rounding this test is about
    mask = torch.ones(3, dtype=torch.bool)
    for clip in (0.5, None):
        terms = value_loss_terms(v, v_old, ret, mask, clip=clip)
        assert terms.clipped.tolist() == [0.0, 0.0, 0.0], (clip, terms.clipped)
        assert torch.equal(terms.loss, 0.5 * (v - ret).square())
        _, stats = value_loss_with_stats(v, v_old, ret, mask, clip=clip)
        assert float(stats["vf_clip_frac"]) == 0.0


def test_value_loss_terms_clipped_tokens_have_zero_gradient():
    v = torch.tensor([[2.0, 0.1, -3.0]], requires_grad=True)
    terms = value_loss_terms(v, torch.zeros(1, 3), torch.tensor([[0.0, 0.0, 0.0]]),
                             torch.ones(1, 3, dtype=torch.bool), clip=0.5)
    # v_old = R = 0: clipping v towards v_old brings it closer to R, so the max keeps the unclipped
    # branch (PPO's pessimistic value clip)
    assert terms.clipped.tolist() == [[0.0, 0.0, 0.0]]
    terms = value_loss_terms(v, torch.tensor([[3.0, 0.0, -4.0]]), torch.tensor([[0.0, 0.0, 0.0]]),
                             torch.ones(1, 3, dtype=torch.bool), clip=0.5)
    assert terms.clipped.tolist() == [[1.0, 0.0, 1.0]]
    terms.loss.sum().backward()
    assert v.grad[0, 0] == 0 and v.grad[0, 2] == 0 and v.grad[0, 1] != 0


# --------------------------------------------------------------------------------------------
# SFT, Bradley-Terry, DPO
# --------------------------------------------------------------------------------------------

@SETTINGS
@given(shape=shapes, seed=st.integers(0, 2**16))
def test_sft_loss(shape, seed):
    lead, t = shape
    logp, _, _, _, mask = draw_tokens(seed, lead, t)
    loss = sft_loss(logp, mask)
    assert isinstance(loss, torch.Tensor) and loss.shape == ()
    vals = logp.double()[mask]
    close(loss, -vals.sum() / max(vals.numel(), 1))
    assert torch.equal(loss, sft_loss(poison(logp, mask), mask))
    loss2, stats = sft_loss_with_stats(logp, mask)
    assert torch.equal(loss, loss2) and float(stats["n_tokens"]) == mask.sum()


@SETTINGS
@given(n=st.integers(1, 12), scale=st.sampled_from([0.1, 3.0, 50.0]), seed=st.integers(0, 2**16))
def test_bradley_terry_loss(n, scale, seed):
    torch.manual_seed(seed)
    chosen = (torch.randn(n) * scale).requires_grad_()
    rejected = torch.randn(n) * scale
    loss = bradley_terry_loss(chosen, rejected)
    c, r = chosen.detach().double().tolist(), rejected.double().tolist()
    # -log sigmoid(d) = log(1 + exp(-d)), written stably
    ref = sum(max(-(a - b), 0.0) + math.log1p(math.exp(-abs(a - b))) for a, b in zip(c, r)) / n
    close(loss, ref, atol=1e-5)
    loss.backward()
    ref_grad = [-1.0 / (1.0 + math.exp(min(a - b, 700.0))) / n for a, b in zip(c, r)]
    close(chosen.grad, torch.tensor(ref_grad), atol=1e-6)
    _, stats = bradley_terry_loss_with_stats(chosen, rejected)
    close(stats["accuracy"], sum(a > b for a, b in zip(c, r)) / n)
    close(stats["margin"], sum(a - b for a, b in zip(c, r)) / n, atol=1e-5 * scale)


@SETTINGS
@given(n=st.integers(1, 10), kind=st.sampled_from(["sigmoid", "ipo"]), beta=st.sampled_from([0.1, 0.5]),
       seed=st.integers(0, 2**16))
def test_dpo_loss(n, kind, beta, seed):
    torch.manual_seed(seed)
    pc, pr = (-torch.rand(n) * 20).requires_grad_(), (-torch.rand(n) * 20).requires_grad_()
    rc, rr = -torch.rand(n) * 20, -torch.rand(n) * 20
    loss = dpo_loss(pc, pr, rc, rr, beta=beta, kind=kind)
    loss.backward()
    pc64, pr64 = pc.detach().double().requires_grad_(), pr.detach().double().requires_grad_()
    terms = []
    for i in range(n):
        logits = (pc64[i] - pr64[i]) - (float(rc[i]) - float(rr[i]))
        if kind == "sigmoid":
            terms.append(-torch.nn.functional.logsigmoid(beta * logits))
        else:
            terms.append((logits - 1 / (2 * beta)) ** 2)
    ref = sum(terms) / n
    ref.backward()
    # log-probs up to 20 in magnitude: float32 differences lose ~20 * 2^-24 absolute
    close(loss, ref, rtol=1e-5, atol=1e-5)
    close(pc.grad, pc64.grad, rtol=1e-5, atol=1e-5)
    close(pr.grad, pr64.grad, rtol=1e-5, atol=1e-5)
    _, stats = dpo_loss_with_stats(pc, pr, rc, rr, beta=beta, kind=kind)
    r_c = beta * (pc64.detach() - rc.double())
    r_r = beta * (pr64.detach() - rr.double())
    close(stats["chosen_reward"], r_c.mean(), atol=1e-5)
    close(stats["rejected_reward"], r_r.mean(), atol=1e-5)
    close(stats["margin"], (r_c - r_r).mean(), atol=1e-5)
    close(stats["reward_accuracy"], (r_c > r_r).double().mean())


@SETTINGS
@given(n=st.integers(0, 10), kind=st.sampled_from(["sigmoid", "ipo"]), seed=st.integers(0, 2**16))
def test_mean_forms_are_the_sum_forms_divided_by_the_count(n, kind, seed):
    torch.manual_seed(seed)
    logp, mask = -torch.rand(3, n + 1) * 5, torch.rand(3, n + 1) < 0.5
    nll_sum, count = sft_loss_sum(logp, mask)
    assert float(count) == mask.sum() and torch.equal(nll_sum / count.clamp(min=1), sft_loss(logp, mask))
    c, r = torch.randn(n) * 3, torch.randn(n) * 3
    bt_sum, bt_stats = bradley_terry_loss_sum(c, r)
    bt, bt_mean_stats = bradley_terry_loss_with_stats(c, r)
    assert torch.equal(bt_sum / max(n, 1), bt)
    assert _floats(bt_stats, max(n, 1)) == pytest.approx(_floats(bt_mean_stats))
    shifted, _ = bradley_terry_loss_sum(c, r, margin=0.5)  # margin: the same loss at c - 0.5
    close(shifted, bradley_terry_loss_sum(c - 0.5, r)[0])
    pc, pr, rc, rr = (-torch.rand(n) * 20 for _ in range(4))
    d_sum, d_stats = dpo_loss_sum(pc, pr, rc, rr, beta=0.3, kind=kind)
    d, d_mean_stats = dpo_loss_with_stats(pc, pr, rc, rr, beta=0.3, kind=kind)
    assert torch.equal(d_sum / max(n, 1), d)
    assert _floats(d_stats, max(n, 1)) == pytest.approx(_floats(d_mean_stats))


def _floats(stats, n=1):
    return {k: float(v) / n for k, v in stats.items()}


def test_pair_losses_bad_arguments():
    x = torch.zeros(3)
    with pytest.raises(ConfigError, match=r"kind.*sigmoid.*ipo.*'hinge'"):
        dpo_loss(x, x, x, x, kind="hinge")
    with pytest.raises(ConfigError, match=r"beta.*0"):
        dpo_loss(x, x, x, x, beta=0.0)
    with pytest.raises(BatchError, match="ref_rejected"):
        dpo_loss(x, x, x, torch.zeros(4))
    with pytest.raises(BatchError, match="rejected"):
        bradley_terry_loss(x, torch.zeros(2))
    with pytest.raises(ConfigError, match=r"kind.*'hinge'"):
        dpo_loss_sum(x, x, x, x, kind="hinge")
    with pytest.raises(BatchError, match="rejected"):
        bradley_terry_loss_sum(x, torch.zeros(2))
    with pytest.raises(BatchError, match="logp must have the shape of mask"):
        sft_loss_sum(x, torch.zeros(2, dtype=torch.bool))


def _policy_loss64(logp, old, adv, mask, clip=0.2, dual_clip=None):
    """The contract's formula in float64: token-mean of max(-A r, -A clamp(r)), dual-capped."""
    logp, old, adv = logp.double(), old.double(), adv.double()
    r = torch.exp(logp - old)
    pg = torch.maximum(-adv * r, -adv * r.clamp(1 - clip, 1 + clip))
    if dual_clip is not None:
        pg = torch.where(adv < 0, torch.minimum(pg, -adv * dual_clip), pg)
    return (pg * mask).sum() / mask.sum()


@pytest.mark.parametrize("adv, dual_clip", [([1.0, 1.0], None), ([0.0, 1.0], None),
                                            ([-1.0, 1.0], 3.0)])
def test_policy_loss_stays_finite_past_fp32_exp_overflow(adv, dual_clip):
    # token 0's log-ratio is 99 (exp overflows fp32 past 88.72): the clipped branch, A = 0 or the
    # dual cap make its true loss finite and its gradient 0, and they must stay so (0 * inf was
    # a NaN that spoiled every parameter's gradient); token 1 is an ordinary one
    logp = torch.tensor([[-1.0, -0.5]], requires_grad=True)
    old = torch.tensor([[-100.0, -0.6]])
    advantages = torch.tensor([adv])
    mask = torch.tensor([[True, True]])
    loss, _ = policy_loss(logp, old, advantages, mask, dual_clip=dual_clip)
    (grad,) = torch.autograd.grad(loss, logp)
    logp64 = logp.detach().double().requires_grad_()
    want = _policy_loss64(logp64, old, advantages, mask, dual_clip=dual_clip)
    (want_grad,) = torch.autograd.grad(want, logp64)
    assert torch.isfinite(loss) and torch.isfinite(grad).all(), (loss, grad)
    assert abs(float(loss) - float(want)) <= 1e-6 * (1 + abs(float(want))), (loss, want)
    assert torch.allclose(grad.double(), want_grad, atol=1e-6), (grad, want_grad)
    assert float(grad[0, 0]) == 0.0


def _mask_calls(mask):
    """Each public op that takes a mask, called with ``mask`` on fixed inputs."""
    g = torch.Generator().manual_seed(5)
    x, y, z = (torch.randn(2, 4, generator=g) for _ in range(3))
    return {
        "aggregate": lambda: aggregate(x, mask, "seq-mean-token-mean"),
        "policy_loss": lambda: policy_loss(x, y, z, mask, clip_high=0.3)[0],
        "value_loss": lambda: value_loss(x, y, z, mask),
        "gae": lambda: torch.stack(gae(x, y, mask, gamma=0.9, lam=0.8)),
        "sft_loss": lambda: sft_loss(x, mask),
    }


@pytest.mark.parametrize("op", ["aggregate", "policy_loss", "value_loss", "gae", "sft_loss"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.uint8])
def test_a_mask_of_zeros_and_ones_in_another_dtype_equals_the_bool_mask(op, dtype):
    mask = torch.tensor([[True, False, True, True], [False, True, True, False]])
    assert torch.equal(_mask_calls(mask.to(dtype))[op](), _mask_calls(mask)[op]())


@pytest.mark.parametrize("op", ["aggregate", "policy_loss", "value_loss", "gae", "sft_loss"])
@pytest.mark.parametrize("value", [0.5, -1.0, 2.0])
def test_a_mask_holding_weights_is_refused_not_read_as_true(op, value):
    # a weight such as 0.5 would count as True: a weighted mean was meant, a plain one computed
    mask = torch.tensor([[1.0, 0.0, value, 1.0], [0.0, 1.0, 1.0, 0.0]])
    with pytest.raises(BatchError, match=rf"mask: must be bool or hold only 0 and 1.*got "
                                         rf"{value!r} at index \[0, 2\]"):
        _mask_calls(mask)[op]()
