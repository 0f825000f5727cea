"""fsdpfn.algos loss factories: one naming scheme, and sft, rw and dpo's the same math as
fsdpfn.ops's tensor losses (ppo's and the critic's against float64 references:
tests/unit/test_ppo_critic_reference.py)."""

from __future__ import annotations

import math

import pytest
import torch

import fsdpfn as ff
import fsdpfn.algos as algos
from fsdpfn import ops
ALGOS = ("ppo", "critic", "sft", "rw", "dpo")


@pytest.mark.parametrize("name", ALGOS)
def test_every_algorithm_has_a_loss_fn_objective_and_step(name):
    for suffix in ("_loss_fn", "_objective", "_step"):
        assert callable(getattr(algos, name + suffix)) and name + suffix in algos.__all__


@pytest.mark.parametrize("old", ["ppo_loss", "critic_loss", "rw_loss"])
def test_former_factory_names_are_aliases(old):
    assert getattr(algos, old) is getattr(algos, old + "_fn")


# ------------------------------------------------ the algos' sum-form losses vs float64 loops


def _tokens(seed, B=6, T=9):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g) * 5
    mask = torch.rand(B, T, generator=g) < 0.6
    mask[:, 0] = False
    ref = -torch.rand(B, T, generator=g) * 5
    lens = torch.randint(1, T + 1, (B,), generator=g)
    attn = torch.arange(T)[None, :] < lens[:, None]
    return logp, mask, ref, torch.randn(B, T, generator=g) * 3, attn


def _close(actual, expected, tol=1e-5):
    assert abs(float(actual) - float(expected)) <= tol * (1 + abs(float(expected))), (actual, expected)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
@pytest.mark.parametrize("seed", range(4))
def test_sft_loss_fn_sums_the_masked_nll(agg, seed):
    logp, mask, *_ = _tokens(seed)
    loss_sum, stats = algos.sft_loss_fn(ff.SFTConfig(agg=agg))({"logp": logp}, {"loss_mask": mask},
                                                               None)
    rows = [[-float(x) for x, m in zip(lp, mk) if m] for lp, mk in zip(logp.double(), mask)]
    if agg == "token-mean":
        want = sum(sum(r) for r in rows)
    elif agg == "seq-mean-token-sum":
        want = sum(sum(r) for r in rows if r)
    else:
        want = sum(sum(r) / len(r) for r in rows if r)
    _close(loss_sum, want)
    assert stats == {}
    if agg == "token-mean":  # divided by the token count, it is ops.sft_loss exactly
        assert torch.equal(loss_sum / mask.sum(), ops.sft_loss(logp, mask))


@pytest.mark.parametrize("margin", [0.0, 0.7])
@pytest.mark.parametrize("seed", range(4))
def test_rw_loss_fn_is_bradley_terry_on_last_token_scores(margin, seed):
    *_, scores, attn = _tokens(seed)
    loss_sum, stats = algos.rw_loss_fn(ff.RWConfig(margin=margin))({"scores": scores},
                                                                   {"attention_mask": attn}, None)
    last = [float(scores[b, int(attn[b].sum()) - 1]) for b in range(scores.shape[0])]
    pairs = list(zip(last[0::2], last[1::2]))
    _close(loss_sum, sum(math.log1p(math.exp(-(c - r - margin))) for c, r in pairs))
    _close(stats["accuracy"], sum(c > r for c, r in pairs))
    _close(stats["margin"], sum(c - r for c, r in pairs))
    _close(stats["chosen_score"], sum(c for c, _ in pairs))
    _close(stats["rejected_score"], sum(r for _, r in pairs))
    if margin == 0.0:  # divided by the pair count, it is ops.bradley_terry_loss exactly
        s = torch.tensor(last).view(-1, 2)
        assert torch.equal(loss_sum / len(pairs), ops.bradley_terry_loss(s[:, 0], s[:, 1]))


@pytest.mark.parametrize("kind", ["sigmoid", "ipo"])
@pytest.mark.parametrize("seed", range(4))
def test_dpo_loss_fn_is_dpo_on_sequence_logp_sums(kind, seed):
    logp, mask, ref, *_ = _tokens(seed)
    beta = 0.2
    loss_sum, stats = algos.dpo_loss_fn(ff.DPOConfig(kind=kind, beta=beta))(
        {"logp": logp}, {"loss_mask": mask, "ref_logp": ref}, None)
    seq = lambda x: [sum(float(v) for v, m in zip(row, mk) if m) for row, mk in zip(x.double(), mask)]
    pi, rf = seq(logp), seq(ref)
    want, rewards = 0.0, []
    for i in range(0, len(pi), 2):
        z = (pi[i] - pi[i + 1]) - (rf[i] - rf[i + 1])
        want += math.log1p(math.exp(-beta * z)) if kind == "sigmoid" else (z - 1 / (2 * beta)) ** 2
        rewards.append((beta * (pi[i] - rf[i]), beta * (pi[i + 1] - rf[i + 1])))
    _close(loss_sum, want, tol=1e-4)
    _close(stats["reward_accuracy"], sum(c > r for c, r in rewards))
    _close(stats["chosen_reward"], sum(c for c, _ in rewards), tol=1e-4)
    _close(stats["margin"], sum(c - r for c, r in rewards), tol=1e-4)
