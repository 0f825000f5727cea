"""Trainer-rollout corrections (fsdpfn.ops.correction), CISPO and the PPOConfig fields that select
them, against float64 references written from the papers' formulas with loops.

References: truncated IS (TIS, Yao et al. 2025 "Your efficient RL framework secretly brings you
off-policy RL training"): w = min(pi_old / pi_behav, C); masked IS (ICE-POP, Ling team 2025; the
sequence and geometric masks of Liu, Li et al. 2025 "When speed kills stability"): w =
ratio * 1[low <= ratio <= high] with ratio per token, the product over the row, or its geometric
mean; CISPO (MiniMax-M1 2025): J = sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi.
Tolerances as in test_ops_losses.py: float32 ops vs float64 references, rtol 1e-5, atol 1e-6.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tensordict import TensorDict

import fsdpfn as ff
from fsdpfn import serde
from fsdpfn.algos.ppo import _requirements, warn_if_off_policy
from fsdpfn.errors import BatchError, ConfigError
from fsdpfn.ops import (aggregate, behav_gap_terms, behav_log_ratio, behav_stats, behav_weights,
                        policy_loss, policy_loss_terms)

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True, database=None)
MODES = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
LEVELS = ["token", "sequence", "geometric"]
RTOL, ATOL = 1e-5, 1e-6

shapes = st.tuples(st.lists(st.integers(1, 4), min_size=1, max_size=2), st.integers(1, 9))
bounds = st.sampled_from([(None, 1.5), (0.5, 2.0), (0.8, 1.2), (0.0, 3.0)])


def close(actual, expected, *, rtol=RTOL, atol=ATOL, what=""):
    torch.testing.assert_close(torch.as_tensor(actual).double(), torch.as_tensor(expected).double(),
                               rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def poison(x, mask):
    junk = torch.tensor([float("nan"), float("inf"), float("-inf"), 1e30, -1e30])
    fill = junk[torch.arange(x.numel()) % len(junk)].reshape(x.shape).to(x.dtype)
    return torch.where(mask, x, fill)


def draw(seed, lead, t, *, spread=0.3, keep=0.7):
    torch.manual_seed(seed)
    shape = (*lead, t)
    logp = -torch.rand(shape) * 3.0
    old = logp + torch.randn(shape) * spread
    behav = old + torch.randn(shape) * spread
    adv = torch.randn(shape)
    mask = torch.rand(shape) < keep
    return logp, old, behav, adv, mask


def rows_of(*xs, t):
    return [None if x is None else x.detach().double().reshape(-1, t) for x in xs]


# --------------------------------------------------------------------------------------------
# float64 references, row by row
# --------------------------------------------------------------------------------------------

def ref_weights(old, behav, mask, correction, level, low, high):
    """Per row: (weights {t: w}, truncated {t}, masked {t}) from the formulas in the docstring."""
    if correction == "mis" and low is None:
        low = 1.0 / high
    out = []
    for b in range(old.shape[0]):
        idx = [t for t in range(old.shape[1]) if mask[b, t]]
        logs = {t: float(old[b, t]) - float(behav[b, t]) for t in idx}
        if level == "sequence":
            logs = {t: sum(logs.values()) for t in idx}
        elif level == "geometric":
            logs = {t: sum(logs.values()) / len(idx) for t in idx}
        w, trunc, masked = {}, set(), set()
        for t in idx:
            ratio = math.exp(min(logs[t], 700.0)) if logs[t] < 700 else math.inf
            out_of_band = correction is not None and (ratio > high or ratio < (low or 0.0))
            if correction == "tis":
                w[t] = min(max(ratio, low or 0.0), high)
                if out_of_band:
                    trunc.add(t)
            elif correction == "mis":
                w[t] = 0.0 if out_of_band else ratio
                if out_of_band:
                    masked.add(t)
            else:
                w[t] = ratio
        out.append((w, trunc, masked))
    return out


def dense(rows, shape, pick):
    x = torch.zeros(shape, dtype=torch.float64)
    for b, row in enumerate(rows):
        for t, v in pick(row).items():
            x[b, t] = v
    return x


# --------------------------------------------------------------------------------------------
# weights and masks
# --------------------------------------------------------------------------------------------

@SETTINGS
@given(shape=shapes, correction=st.sampled_from([None, "tis", "mis"]), level=st.sampled_from(LEVELS),
       bnd=bounds, spread=st.sampled_from([0.05, 0.3, 1.5]), seed=st.integers(0, 2**16))
def test_behav_weights_match_reference(shape, correction, level, bnd, spread, seed):
    lead, t = shape
    _, old, behav, _, mask = draw(seed, lead, t, spread=spread)
    low, high = bnd if correction else (None, None)
    if correction is None and level != "token":
        high = None
    out = behav_weights(old, behav, mask, correction=correction, level=level, low=low, high=high)
    o64, b64 = rows_of(old, behav, t=t)
    m2 = mask.reshape(-1, t)
    ref = ref_weights(o64, b64, m2, correction, level, low, high)
    shape2 = m2.shape
    close(out.weight.reshape(shape2), dense(ref, shape2, lambda r: r[0]), what="weight")
    flags = lambda k: dense(ref, shape2, lambda r: {i: 1.0 for i in r[k]})  # noqa: E731
    assert torch.equal(out.truncated.reshape(shape2).double(), flags(1))
    assert torch.equal(out.masked.reshape(shape2).double(), flags(2))
    assert torch.equal(out.seq_truncated.reshape(-1).double(), (flags(1).sum(-1) > 0).double())
    assert torch.equal(out.seq_masked.reshape(-1).double(), (flags(2).sum(-1) > 0).double())
    for x in out:
        assert not x.requires_grad and x.dtype == torch.float32
    # values under a False mask change nothing
    again = behav_weights(poison(old, mask), poison(behav, mask), mask, correction=correction,
                          level=level, low=low, high=high)
    for a, b in zip(out, again):
        assert torch.equal(a, b)


@SETTINGS
@given(shape=shapes, level=st.sampled_from(LEVELS), correction=st.sampled_from(["tis", "mis"]),
       seed=st.integers(0, 2**16))
def test_row_weights_are_local_to_each_row(shape, level, correction, seed):
    """Row-level weights use only their row: splitting rows over micro-batches or ranks, or
    permuting them, gives the same weights (a row is never split)."""
    lead, t = shape
    _, old, behav, _, mask = draw(seed, lead, t, spread=0.5)
    o, b, m = old.reshape(-1, t), behav.reshape(-1, t), mask.reshape(-1, t)
    kw = dict(correction=correction, level=level, high=1.5)
    whole = behav_weights(o, b, m, **kw)
    perm = torch.randperm(o.shape[0])
    permuted = behav_weights(o[perm], b[perm], m[perm], **kw)
    for a, p in zip(whole, permuted):
        assert torch.equal(a[perm], p)
    half = o.shape[0] // 2
    parts = [behav_weights(o[s], b[s], m[s], **kw) for s in (slice(0, half), slice(half, None))]
    for i, a in enumerate(whole):
        assert torch.equal(a, torch.cat([p[i] for p in parts]))
    if level != "token":  # one value per row, on its loss tokens
        w = behav_log_ratio(o, b, m, level)
        for r in range(o.shape[0]):
            assert w[r][m[r]].unique().numel() <= 1


def test_long_rows_overflow_to_the_bound_not_to_nan():
    T = 400
    old = torch.zeros(2, T)
    behav = torch.full((2, T), -1.0)  # token ratio e, row product e^400: inf in float32
    behav[1] = 1.0                    # row product e^-400: 0
    mask = torch.ones(2, T, dtype=torch.bool)
    tis = behav_weights(old, behav, mask, correction="tis", level="sequence", low=0.5, high=2.0)
    assert torch.equal(tis.weight[0], torch.full((T,), 2.0))
    assert torch.equal(tis.weight[1], torch.full((T,), 0.5))
    mis = behav_weights(old, behav, mask, correction="mis", level="sequence", high=2.0)
    assert not mis.weight.any() and mis.masked.all() and mis.seq_masked.tolist() == [1.0, 1.0]
    geo = behav_weights(old, behav, mask, correction="mis", level="geometric", high=3.0)
    close(geo.weight[0], torch.full((T,), math.e), what="geometric mean of e")
    close(geo.weight[1], torch.full((T,), math.exp(-1)), what="e^-1 > 1/3: kept")
    tight = behav_weights(old, behav, mask, correction="mis", level="geometric", high=2.5)
    assert not tight.weight.any()  # e > 2.5 and e^-1 < 1/2.5


# --------------------------------------------------------------------------------------------
# diagnostics
# --------------------------------------------------------------------------------------------

@SETTINGS
@given(shape=shapes, correction=st.sampled_from(["tis", "mis"]), level=st.sampled_from(LEVELS),
       keep=st.sampled_from([0.0, 0.5, 1.0]), seed=st.integers(0, 2**16))
def test_behav_stats_match_reference(shape, correction, level, keep, seed):
    lead, t = shape
    _, old, behav, _, mask = draw(seed, lead, t, spread=0.7, keep=keep)
    weights = behav_weights(old, behav, mask, correction=correction, level=level, high=1.5)
    stats = behav_stats(old, behav, mask, weights)
    o64, b64 = rows_of(old, behav, t=t)
    m2 = mask.reshape(-1, t)
    ref = ref_weights(o64, b64, m2, correction, level, None, 1.5)
    toks = [(b, i) for b in range(m2.shape[0]) for i in range(t) if m2[b, i]]
    rows = [b for b in range(m2.shape[0]) if m2[b].any()]
    n, nr = max(len(toks), 1), max(len(rows), 1)
    gaps = [abs(float(o64[b, i] - b64[b, i])) for b, i in toks]
    k3 = [math.exp(float(o64[b, i] - b64[b, i])) - float(o64[b, i] - b64[b, i]) - 1 for b, i in toks]
    expected = {"behav_gap_mean": sum(gaps) / n, "behav_gap_max": max(gaps, default=0.0),
                "behav_kl": sum(k3) / n,
                "behav_trunc_frac": sum(len(r[1]) for r in ref) / n,
                "behav_mask_frac": sum(len(r[2]) for r in ref) / n,
                "behav_seq_trunc_frac": sum(bool(ref[b][1]) for b in rows) / nr,
                "behav_seq_mask_frac": sum(bool(ref[b][2]) for b in rows) / nr}
    assert set(stats) == set(expected)
    for k, v in expected.items():
        assert stats[k].shape == () and stats[k].dtype == torch.float32
        close(stats[k], v, what=k)
    gap, kl3 = behav_gap_terms(old, behav, mask)
    assert not gap[~mask].any() and not kl3[~mask].any() and (kl3 >= 0).all()


# --------------------------------------------------------------------------------------------
# policy loss with corrections, and CISPO
# --------------------------------------------------------------------------------------------

def ref_loss(logp, old, adv, mask, weights, *, kind, lo, hi, agg):
    """Per-token PPO (max of the two surrogates) or CISPO (the paper's -sg(clip r) A log pi, whose
    gradient is the reference; its value is written as -A clip(r)), times the behaviour weight."""
    R, T = logp.shape
    rows, values = [], []
    for b in range(R):
        row, vals = [], []
        for t in range(T):
            if not mask[b, t]:
                continue
            w = weights[b][0][t] if weights is not None else 1.0
            lr = logp[b, t] - old[b, t]
            r = torch.exp(lr)
            a = float(adv[b, t])
            kept = min(max(float(r.detach()), 1 - lo), 1 + hi)
            if kind == "cispo":
                row.append(-kept * a * logp[b, t] * w)
                vals.append(-a * kept * w)
            else:
                pg = torch.maximum(-a * r, -a * torch.clamp(r, 1 - lo, 1 + hi)) * w
                row.append(pg)
                vals.append(float(pg.detach()))
        rows.append(row)
        values.append(vals)
    zero = torch.zeros((), dtype=torch.float64)

    def reduce(rs):
        rs = [r for r in rs if r]
        if agg == "token-mean":
            flat = [v for r in rs for v in r]
            return sum(flat, zero) / max(len(flat), 1)
        per = [sum(r, zero) / (len(r) if agg == "seq-mean-token-mean" else 1) for r in rs]
        return sum(per, zero) / max(len(per), 1)
    return reduce(rows), reduce(values)


@SETTINGS
@given(shape=shapes, kind=st.sampled_from(["ppo", "cispo"]), agg=st.sampled_from(MODES),
       correction=st.sampled_from([None, "tis", "mis"]), level=st.sampled_from(LEVELS),
       spread=st.sampled_from([0.05, 0.5]), seed=st.integers(0, 2**16))
def test_policy_loss_with_corrections_matches_reference(shape, kind, agg, correction, level,
                                                       spread, seed):
    lead, t = shape
    logp, old, behav, adv, mask = draw(seed, lead, t, spread=spread)
    level = level if correction else "token"
    high = 1.5 if correction else None
    lo, hi = (0.2, 0.28) if kind == "ppo" else (1.0, 0.28)  # CISPO: no lower bound
    logp.requires_grad_()
    loss, stats = policy_loss(logp, old, adv, mask, clip_low=lo, clip_high=hi, agg=agg, kind=kind,
                              behav_logp=behav, behav_correction=correction, behav_level=level,
                              behav_high=high)
    loss.backward()
    lp64, o64, b64, a64 = rows_of(logp, old, behav, adv, t=t)
    lp64.requires_grad_()
    m2 = mask.reshape(-1, t)
    weights = ref_weights(o64, b64, m2, correction, level, None, high)
    ref_surrogate, ref_value = ref_loss(lp64, o64, a64, m2, weights, kind=kind, lo=lo, hi=hi, agg=agg)
    close(loss, ref_value, what="loss value")
    if ref_surrogate.requires_grad:
        ref_surrogate.backward()
        close(logp.grad.reshape(-1, t), lp64.grad, what="grad")
    else:
        assert not logp.grad.any()
    assert ("behav_mask_frac" in stats) == (correction is not None)


@SETTINGS
@given(shape=shapes, seed=st.integers(0, 2**16))
def test_cispo_keeps_the_gradient_of_clipped_tokens(shape, seed):
    """Unlike PPO, CISPO never zeroes a token's gradient: it is -A clip(r) on every loss token."""
    lead, t = shape
    logp, old, _, adv, mask = draw(seed, lead, t, spread=1.0)
    logp.requires_grad_()
    terms = policy_loss_terms(logp, old, adv, mask, clip_low=0.2, clip_high=0.28, kind="cispo")
    terms.loss.sum().backward()
    r = (logp - old).detach().exp()
    close(logp.grad[mask], (-adv * r.clamp(0.8, 1.28))[mask], what="cispo grad")
    assert not logp.grad[~mask].any()
    close(terms.clipped[mask], ((r < 0.8) | (r > 1.28)).float()[mask], what="clipped")


@SETTINGS
@given(shape=shapes, agg=st.sampled_from(MODES), seed=st.integers(0, 2**16))
def test_cispo_at_ratio_one_equals_ppo(shape, agg, seed):
    lead, t = shape
    logp, _, _, adv, mask = draw(seed, lead, t)
    grads = []
    for kind in ("ppo", "cispo"):
        lp = logp.clone().requires_grad_()
        loss, _ = policy_loss(lp, logp, adv, mask, agg=agg, kind=kind)
        close(loss, -aggregate(adv, mask, agg), what=kind)
        loss.backward()
        grads.append(lp.grad)
    close(grads[0], grads[1], what="grad")


def test_behav_cap_keeps_todays_numbers():
    """behav_cap is token TIS: the weight is exp(old - behav) clamped at the cap, bit for bit."""
    logp, old, behav, adv, mask = draw(3, [4], 9, spread=0.8)
    terms = policy_loss_terms(logp, old, adv, mask, behav_logp=behav, behav_cap=1.3)
    expected = torch.where(mask, (old - behav).exp().clamp(max=1.3), torch.zeros(()))
    assert torch.equal(terms.behav_weight, expected)
    _, stats = policy_loss(logp, old, adv, mask, behav_logp=behav, behav_cap=1.3)
    assert "behav_trunc_frac" not in stats  # policy_loss's stats without a correction: unchanged
    assert terms.behav.truncated.sum() == ((old - behav).exp() > 1.3)[mask].sum()


def test_bad_arguments_name_the_argument_rule_and_value():
    x, m = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ConfigError, match=r"behav_correction.*tis.*mis.*'clip'"):
        behav_weights(x, x, m, correction="clip", high=2.0)
    with pytest.raises(ConfigError, match=r"behav_level.*geometric.*'seq'"):
        behav_weights(x, x, m, correction="tis", level="seq", high=2.0)
    with pytest.raises(ConfigError, match=r"behav_high.*> 0.*None"):
        behav_weights(x, x, m, correction="mis")
    with pytest.raises(ConfigError, match=r"behav_low.*< behav_high.*3\.0"):
        behav_weights(x, x, m, correction="tis", low=3.0, high=2.0)
    with pytest.raises(BatchError, match=r"behav_logp.*required.*'mis'"):
        policy_loss(x, x, x, m, behav_correction="mis", behav_high=2.0)
    with pytest.raises(ConfigError, match=r"behav_cap.*None.*'tis'.*2\.0"):
        policy_loss(x, x, x, m, behav_logp=x, behav_cap=2.0, behav_correction="tis", behav_high=2.0)
    with pytest.raises(ConfigError, match=r"kind.*ppo.*cispo.*'grpo'"):
        policy_loss(x, x, x, m, kind="grpo")
    with pytest.raises(ConfigError, match=r"dual_clip.*cispo.*3\.0"):
        policy_loss(x, x, x, m, kind="cispo", dual_clip=3.0)
    with pytest.raises(BatchError, match=r"behav_logp.*shape"):
        behav_weights(x, torch.zeros(2, 4), m, correction="tis", high=2.0)


# --------------------------------------------------------------------------------------------
# PPOConfig and ppo_step's plumbing
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    (dict(behav_level="sequence"), r"behav_level: needs behav_correction.*'sequence'"),
    (dict(behav_high=2.0), r"behav_high: needs behav_correction.*2\.0"),
    (dict(behav_correction="tis", behav_cap=2.0), r"behav_cap: must be None.*'tis'.*2\.0"),
    (dict(behav_correction="mis", use_behav_logp=False), r"use_behav_logp: must be True.*False"),
    (dict(behav_cap=2.0, use_behav_logp=False), r"use_behav_logp: must be True.*behav_cap=2\.0"),
    (dict(behav_correction="mis", behav_low=3.0), r"behav_low: must be < behav_high \(2\.0\).*3\.0"),
    (dict(behav_correction="sis"), r"behav_correction: must be one of.*'sis'"),
    (dict(policy_loss="cispo", dual_clip=3.0), r"dual_clip: must be None.*cispo.*3\.0"),
    (dict(cispo_clip_high=0.3), r"cispo_clip_high: needs policy_loss='cispo'.*0\.3"),
    (dict(policy_loss="cispo", cispo_clip_low=1.5), r"cispo_clip_low: must be <= 1.*1\.5"),
    (dict(on_policy_tol=0.0), r"on_policy_tol: must be > 0.*0\.0"),
])
def test_ppo_config_rejects_contradictions(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        ff.PPOConfig(**kwargs)


def test_ppo_config_new_fields_round_trip_and_override():
    cfg = ff.PPOConfig(behav_correction="mis", behav_level="geometric", behav_low=0.5,
                       behav_high=2.0, policy_loss="cispo", cispo_clip_high=0.3,
                       check_on_policy=True, on_policy_tol=1e-4)
    assert serde.from_yaml(serde.to_yaml(cfg), ff.PPOConfig) == cfg
    data = serde.apply_overrides(serde.unstructure(ff.PPOConfig()),
                                 ["behav_correction=tis", "behav_level=sequence", "policy_loss=cispo"])
    over = serde.structure(data, ff.PPOConfig)
    assert (over.behav_correction, over.behav_level, over.behav_bounds) == ("tis", "sequence",
                                                                            (None, 2.0))
    assert over.cispo_bounds == (1.0, 0.2)  # no lower bound; the PPO upper clip
    assert ff.PPOConfig().behav_bounds == (None, None)


def test_a_configured_correction_requires_behav_logp():
    require, why = _requirements(ff.PPOConfig(behav_correction="tis"))
    assert "behav_logp" in require and "behav_correction='tis'" in why["behav_logp"]
    require, why = _requirements(ff.PPOConfig(behav_cap=2.0))
    assert "behav_logp" in require and "behav_cap=2.0" in why["behav_logp"]
    assert "behav_logp" not in _requirements(ff.PPOConfig())[0]  # default: used when present


def test_on_policy_check_warns_with_the_likely_causes():
    cfg = ff.PPOConfig(check_on_policy=True, on_policy_tol=1e-3, temperature=0.7)
    quiet = TensorDict({"on_policy_gap": torch.tensor(5e-4)}, batch_size=[])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_off_policy(quiet, cfg)
    loud = TensorDict({"on_policy_gap": torch.tensor(0.05), "behav_gap_mean": torch.tensor(0.2)},
                      batch_size=[])
    with pytest.warns(RuntimeWarning) as record:
        warn_if_off_policy(loud, cfg)
    msg = str(record[0].message)
    for part in ("0.05", "on_policy_tol=0.001", "behav_gap_mean=0.2", "not pushed",
                 "temperature=0.7", "dtype or kernel"):
        assert part in msg, (part, msg)
