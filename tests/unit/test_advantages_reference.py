"""compute_advantages (the public entry point) against float64 loops written here from the docs.

The reference reads only docs/api.md ("Conventions where the contract is silent", the batch
layout, ``group_id``), the AdvantageConfig docstring and fields, docs/recipes.md's advantage table
and the docstrings of fsdpfn/algos/advantages.py and fsdpfn/ops (kl, gae, whiten): nothing of
fsdpfn's is called but compute_advantages itself. The documented math, per estimator:

- rewards: r' = clip(r·reward_scale + reward_bias, ±reward_clip);
- KL per loss token: kl_coef·kl(old_logp (else logp), ref_logp, kl_kind), k1/k2/k3/abs;
- grpo: (r' − mean(group)) / (unbiased std(group) + eps); drgrpo: r' − mean(group); rloo:
  r' − mean of the group's other rows; broadcast to the row's loss tokens, minus the KL
  penalty's return-to-go (sum over this and later loss tokens of the row);
- reinforce++: token rewards (r' at the row's last loss token, minus the KL per loss token),
  gamma-discounted returns-to-go over the loss tokens, whitened over all loss tokens of the
  batch: (x − mean) / sqrt(unbiased var + 1e-8);
- gae: token rewards (r' at the last loss token + token_rewards − KL) through GAE(gamma, lam),
  the recursion running over loss tokens only (gaps skipped, V_next / A_next from the next loss
  token, 0 after the last); returns = advantages + values;
- whiten: the advantages whitened as above; every output 0 off the loss mask;
- returns: "what a critic regresses on (GAE), or a copy of the advantages".

Batches: seeded, rows right-padded to T with variable lengths, loss_mask starting after a prompt
of variable length, some rows with a gap in their loss mask (a multi-turn tool output), values
and dense rewards nonzero on prompt tokens (which must not leak), groups consecutive, or
interleaved or shuffled through ``group_id`` with arbitrary ids.
"""

from __future__ import annotations

import math

import pytest
import torch
from tensordict import TensorDict

import fsdpfn as ff

B, T, G = 12, 14, 4
SEEDS = (0, 1, 2)
WHITEN_EPS = 1e-8  # docs/recipes.md advantage.whiten: sqrt(unbiased var + 1e-8)


# ---------------------------------------------------------------- batches


def make_batch(seed: int, *, group_id: str | None = None, old_logp: bool = True,
               token_rewards: bool = False, values: bool = False, gaps: bool = True,
               tied: bool = False) -> TensorDict:
    """A public-layout batch of B rows. group_id: None (rows [kG, (k+1)G) are group k),
    "interleaved" (row i in group i % (B/G), arbitrary ids) or "shuffled" (a random assignment).
    tied: one group with equal rewards (std 0: eps alone divides)."""
    g = torch.Generator().manual_seed(1000 + seed)
    lens = torch.randint(5, T + 1, (B,), generator=g)
    lens[0] = T  # one full-length row
    attn = torch.arange(T)[None] < lens[:, None]
    loss = torch.zeros(B, T, dtype=torch.bool)
    for b in range(B):
        L = int(lens[b])
        p = int(torch.randint(1, L - 1, (1,), generator=g))  # prompt [0, p), at least 1 token
        loss[b, p:L] = True
        if gaps and b % 3 == 1 and L - p >= 4:  # a gap (tool output) inside the response
            start = p + 1 + int(torch.randint(0, L - p - 3, (1,), generator=g))
            loss[b, start:start + 2] = False
    ids = torch.where(attn, torch.randint(0, 128, (B, T), generator=g), 0)
    real = attn.clone()
    real[:, 0] = False  # logp-like keys: 0 where t=0 or attention_mask is False

    def token_float(scale=1.0, shift=0.0):
        x = torch.randn(B, T, generator=g) * scale + shift
        return torch.where(real, x, torch.zeros(())).float()

    rewards = torch.randn(B, generator=g) * 1.5
    if tied:
        rewards[G:2 * G] = 0.75  # one consecutive group tied (without group_id)
    data = {"input_ids": ids, "attention_mask": attn, "loss_mask": loss,
            "rewards": rewards.float(),
            "logp": token_float(0.5, -1.5).clamp(max=0.0),
            "ref_logp": token_float(0.5, -1.5).clamp(max=0.0)}
    if old_logp:
        data["old_logp"] = token_float(0.5, -1.5).clamp(max=0.0)
    if token_rewards:
        data["token_rewards"] = token_float(0.3)
    if values:
        data["values"] = token_float(0.8, 0.2)
    if group_id == "interleaved":
        n = B // G
        base = torch.tensor([7, -3, 42])[:n]
        data["group_id"] = base[torch.arange(B) % n].long()
    elif group_id == "shuffled":
        perm = torch.randperm(B, generator=g)
        data["group_id"] = (perm // G * 11 + 5).long()
    return TensorDict(data, batch_size=[B])


# ---------------------------------------------------------------- float64 reference


def f64(batch, key):
    return batch[key].double().tolist()


def ref_rewards(batch, cfg) -> list[float]:
    out = []
    for r in f64(batch, "rewards"):
        x = r * cfg["reward_scale"] + cfg["reward_bias"]
        if cfg["reward_clip"] is not None:
            x = min(max(x, -cfg["reward_clip"]), cfg["reward_clip"])
        out.append(x)
    return out


def ref_kl(lp: float, ref: float, kind: str) -> float:
    d = lp - ref
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d * d
    if kind == "abs":
        return abs(d)
    assert kind == "k3"
    return min(max(math.exp(-d) + d - 1.0, -10.0), 10.0)


def ref_penalty(batch, cfg) -> list[list[float]]:
    """kl_coef·KL on loss tokens, 0 elsewhere; the sampling policy is old_logp, else logp."""
    mask = batch["loss_mask"].tolist()
    if cfg["kl_coef"] == 0:
        return [[0.0] * T for _ in range(B)]
    lp = f64(batch, "old_logp" if "old_logp" in batch.keys() else "logp")
    ref = f64(batch, "ref_logp")
    return [[cfg["kl_coef"] * ref_kl(lp[b][t], ref[b][t], cfg["kl_kind"]) if mask[b][t] else 0.0
             for t in range(T)] for b in range(B)]


def ref_returns_to_go(x, mask, gamma):
    out = [[0.0] * T for _ in range(B)]
    for b in range(B):
        acc = 0.0
        for t in reversed(range(T)):
            if mask[b][t]:
                acc = x[b][t] + gamma * acc
                out[b][t] = acc
    return out


def ref_whiten(x, mask):
    vals = [x[b][t] for b in range(B) for t in range(T) if mask[b][t]]
    n = len(vals)
    mean = sum(vals) / n
    var = sum((v - mean) ** 2 for v in vals) / max(n - 1, 1)
    scale = 1.0 / math.sqrt(var + WHITEN_EPS)
    return [[(x[b][t] - mean) * scale if mask[b][t] else 0.0 for t in range(T)]
            for b in range(B)]


def ref_groups(batch) -> list[list[int]]:
    if "group_id" in batch.keys():
        members: dict[int, list[int]] = {}
        for row, gid in enumerate(batch["group_id"].tolist()):
            members.setdefault(gid, []).append(row)
        return list(members.values())
    return [list(range(k * G, (k + 1) * G)) for k in range(B // G)]


def ref_group_advantages(r, groups, estimator, eps):
    adv = [0.0] * B
    for rows in groups:
        vals = [r[i] for i in rows]
        n = len(vals)
        mean = sum(vals) / n
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (n - 1))
        for i in rows:
            if estimator == "grpo":
                adv[i] = (r[i] - mean) / (std + eps)
            elif estimator == "drgrpo":
                adv[i] = r[i] - mean
            else:  # rloo: the mean of the other rows
                adv[i] = r[i] - (sum(vals) - r[i]) / (n - 1)
    return adv


def ref_gae(rew, val, mask, gamma, lam):
    adv = [[0.0] * T for _ in range(B)]
    for b in range(B):
        next_v = next_a = 0.0
        for t in reversed(range(T)):
            if not mask[b][t]:
                continue
            a = rew[b][t] + gamma * next_v - val[b][t] + gamma * lam * next_a
            adv[b][t] = a
            next_v, next_a = val[b][t], a
    ret = [[adv[b][t] + val[b][t] if mask[b][t] else 0.0 for t in range(T)] for b in range(B)]
    return adv, ret


def reference(batch, cfg: dict):
    """(advantages, returns) [B, T] float64 from the documented math; returns is the signal
    before whitening: GAE's advantages + values, reinforce++'s returns-to-go, a grouped
    estimator's advantages (fsdpfn/algos/advantages.py)."""
    mask = batch["loss_mask"].tolist()
    r = ref_rewards(batch, cfg)
    pen = ref_penalty(batch, cfg)
    est = cfg["estimator"]
    if est in ("grpo", "drgrpo", "rloo"):
        per_row = ref_group_advantages(r, ref_groups(batch), est, cfg["eps"])
        kl_rtg = ref_returns_to_go(pen, mask, 1.0)
        adv = [[per_row[b] - kl_rtg[b][t] if mask[b][t] else 0.0 for t in range(T)]
               for b in range(B)]
    else:
        dense = f64(batch, "token_rewards") if "token_rewards" in batch.keys() else None
        tok = [[0.0] * T for _ in range(B)]
        for b in range(B):
            last = max(t for t in range(T) if mask[b][t])
            for t in range(T):
                if mask[b][t]:
                    tok[b][t] = ((dense[b][t] if dense else 0.0) - pen[b][t]
                                 + (r[b] if t == last else 0.0))
        if est == "gae":
            adv, returns = ref_gae(tok, f64(batch, "values"), mask, cfg["gamma"], cfg["lam"])
        else:  # reinforce++: whitened discounted returns-to-go; returns: those, unwhitened
            returns = ref_returns_to_go(tok, mask, cfg["gamma"])
            adv = ref_whiten(returns, mask)
    if est in GROUPED:  # returns: the advantages before any whitening
        returns = [row[:] for row in adv]
    if cfg["whiten"] and est != "reinforce++":
        adv = ref_whiten(adv, mask)
    return torch.tensor(adv, dtype=torch.float64), torch.tensor(returns, dtype=torch.float64)


# ---------------------------------------------------------------- the comparison

GROUPED = ("grpo", "drgrpo", "rloo")
DEFAULTS = dict(estimator="grpo", group_size=G, gamma=1.0, lam=1.0, kl_coef=0.0, kl_kind="k1",
                reward_scale=1.0, reward_bias=0.0, reward_clip=None, whiten=False, eps=1e-6)


def check(batch, **overrides):
    cfg = {**DEFAULTS, **overrides}
    before = {k: v.clone() for k, v in batch.items()}
    out = ff.compute_advantages(batch, ff.AdvantageConfig(**cfg))
    assert set(batch.keys()) == set(before) and all(torch.equal(batch[k], before[k])
                                                   for k in before), "input batch mutated"
    adv, ret = out["advantages"], out["returns"]
    assert adv.dtype == ret.dtype == torch.float32
    assert adv.shape == ret.shape == (B, T)
    assert adv.data_ptr() != ret.data_ptr()  # separate tensors
    want_adv, want_ret = reference(batch, cfg)
    off = ~batch["loss_mask"]
    assert torch.all(adv[off] == 0) and torch.all(ret[off] == 0)
    torch.testing.assert_close(adv.double(), want_adv, rtol=1e-5, atol=1e-5,
                               msg=lambda m: f"advantages {cfg}: {m}")
    torch.testing.assert_close(ret.double(), want_ret, rtol=1e-5, atol=1e-5,
                               msg=lambda m: f"returns {cfg}: {m}")
    return adv, want_adv


GROUPINGS = (None, "interleaved", "shuffled")


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("grouping", GROUPINGS)
@pytest.mark.parametrize("estimator", GROUPED)
def test_grouped_estimators(estimator, grouping, seed):
    check(make_batch(seed, group_id=grouping), estimator=estimator)


@pytest.mark.parametrize("seed", SEEDS)
def test_grpo_eps_and_a_tied_group(seed):
    """eps is added to the unbiased std; a group of equal rewards gets 0 (0 / eps)."""
    batch = make_batch(seed, tied=True)
    adv, _ = check(batch, estimator="grpo", eps=0.25)
    assert torch.all(adv[G:2 * G] == 0)


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "abs"])
@pytest.mark.parametrize("estimator", GROUPED)
def test_grouped_with_kl_penalty(estimator, kind):
    """kl_coef > 0: each token's advantage loses the KL penalty's return-to-go, KL of old_logp
    (not logp) against ref_logp."""
    for seed, grouping in zip(SEEDS, GROUPINGS):
        check(make_batch(seed, group_id=grouping), estimator=estimator, kl_coef=0.3,
              kl_kind=kind)


def test_kl_reads_logp_when_the_batch_has_no_old_logp():
    for estimator in ("grpo", "reinforce++"):
        check(make_batch(4, old_logp=False), estimator=estimator, kl_coef=0.2)


@pytest.mark.parametrize("estimator", GROUPED)
def test_reward_scale_bias_clip(estimator):
    for seed in SEEDS:
        check(make_batch(seed, group_id="interleaved"), estimator=estimator, reward_scale=1.7,
              reward_bias=-0.3, reward_clip=1.2)
        check(make_batch(seed), estimator=estimator, reward_scale=-0.5, reward_bias=2.0)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma, kl_coef", [(1.0, 0.0), (0.9, 0.0), (1.0, 0.1), (0.8, 0.25)])
def test_reinforce_pp(gamma, kl_coef, seed):
    check(make_batch(seed), estimator="reinforce++", gamma=gamma, kl_coef=kl_coef,
          kl_kind="k3" if seed == 1 else "k1", reward_scale=2.0, reward_bias=-0.5,
          reward_clip=2.5, whiten=seed == 2)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.99, 0.95), (0.7, 0.0), (0.0, 0.5)])
def test_gae_outcome_rewards_on_the_last_loss_token(gamma, lam, seed):
    check(make_batch(seed, values=True), estimator="gae", gamma=gamma, lam=lam)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("gamma, lam, kl_coef", [(1.0, 1.0, 0.0), (0.9, 0.8, 0.0),
                                                 (0.95, 0.9, 0.2)])
def test_gae_token_rewards(gamma, lam, kl_coef, seed):
    """Dense token_rewards plus the outcome at the last loss token, minus the KL."""
    check(make_batch(seed, values=True, token_rewards=True), estimator="gae", gamma=gamma,
          lam=lam, kl_coef=kl_coef, kl_kind="k2", reward_clip=1.0)


@pytest.mark.parametrize("seed", SEEDS)
def test_gae_whiten(seed):
    """whiten: the advantages whitened over the loss tokens; returns stay the GAE returns."""
    check(make_batch(seed, values=True, token_rewards=True), estimator="gae", gamma=0.9,
          lam=0.95, whiten=True)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("estimator", GROUPED)
def test_grouped_whiten(estimator, seed):
    """whiten on a grouped estimator (with the KL term, so a row's tokens differ): the
    advantages whitened over all loss tokens of the batch."""
    check(make_batch(seed, group_id=GROUPINGS[seed]), estimator=estimator, whiten=True,
          kl_coef=0.2)
