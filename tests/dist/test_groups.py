"""Groups and batch statistics over data-parallel ranks: compute_advantages on a sharded batch
with mesh= equals compute_advantages on the whole batch in one process (dp=1), for every
estimator, with groups given by position or by group_id; a split group is refused on every rank.

Hypothesis runs inside the ranks (derandomize=True, database=None: every rank draws the same
examples); ranks return their numbers and the assertions run here, so no rank hangs another.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

import fsdpfn as ff
from fsdpfn import keys as K
from fsdpfn.testing import random_batch, tiny_qwen2_config

ESTIMATORS = ["grpo", "drgrpo", "rloo", "reinforce++", "gae"]
IN_RANK = settings(max_examples=12, deadline=None, derandomize=True, database=None)


def _global_batch(n_groups: int, G: int, T: int, seed: int, order=None):
    """The same global batch on every rank; with ``order`` its rows are permuted and carry
    group_id (groups no longer consecutive)."""
    B = n_groups * G
    batch = random_batch(B, T, seed=seed, group_size=G)
    g = torch.Generator().manual_seed(seed + 1)
    attn = batch[K.ATTENTION_MASK]
    for key in (K.VALUES, K.OLD_LOGP, K.REF_LOGP):
        batch.set(key, torch.where(attn, -torch.rand(B, T, generator=g), 0.0))
    if order is not None:
        batch.set(K.GROUP_ID, torch.arange(n_groups).repeat_interleave(G) * 3 + 1)
        batch = batch[torch.as_tensor(order)]
    return batch


def advantages_dp_vs_whole():
    """Per example: (estimator, whiten, by_id, max |sharded - whole|, max |whole|)."""
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=-1), device_type="cpu")
    results = []

    @IN_RANK
    @given(estimator=st.sampled_from(ESTIMATORS), whiten=st.booleans(), by_id=st.booleans(),
           kl_coef=st.sampled_from([0.0, 0.1]), G=st.integers(2, 4), n_groups=st.integers(2, 5),
           data=st.data())
    def example(estimator, whiten, by_id, kl_coef, G, n_groups, data):
        order = data.draw(st.permutations(range(n_groups * G))) if by_id else None
        batch = _global_batch(n_groups, G, 7, data.draw(st.integers(0, 2**16)), order)
        config = ff.AdvantageConfig(estimator=estimator, group_size=G, whiten=whiten,
                                    kl_coef=kl_coef, gamma=0.9, lam=0.95)
        whole = ff.compute_advantages(batch, config)                       # dp=1
        local = ff.shard_batch(batch, mesh, group_size=1 if by_id else G)
        part = ff.compute_advantages(local, config, mesh=mesh)
        rows = local[K.ROW_INDEX]
        diff = max(float((part[k] - whole[k][rows]).abs().max()) for k in (K.ADVANTAGES,
                                                                           K.RETURNS))
        results.append((estimator, whiten, by_id, diff, float(whole[K.ADVANTAGES].abs().max())))

    example()
    return results


@pytest.mark.timeout(300)
def test_every_estimator_gives_the_same_advantages_at_dp1_and_dp2(spmd2):
    per_rank = spmd2.run(advantages_dp_vs_whole, timeout=240)
    assert per_rank[0] and len(per_rank[0]) == len(per_rank[1])
    covered = set()
    for results in per_rank:
        for estimator, whiten, by_id, diff, scale in results:
            covered.add((estimator, whiten or estimator == "reinforce++"))
            assert diff <= 1e-5 * max(1.0, scale), (estimator, whiten, by_id, diff)
    # whitening (the one dp-global statistic) was exercised, and every estimator ran
    assert {e for e, _ in covered} == set(ESTIMATORS)
    assert any(w for _, w in covered)


def split_groups_are_refused():
    """The default shard_batch (group_size=1, no group_id) splits groups of 4 here; every rank
    must raise, naming the fix, whichever rank found the split."""
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=-1), device_type="cpu")
    batch = random_batch(8, 12, seed=3, group_size=4)
    lens = torch.tensor([12, 2, 11, 3, 10, 4, 9, 5])                       # balancing splits
    batch.set(K.ATTENTION_MASK, torch.arange(12)[None] < lens[:, None])
    batch.set(K.LOSS_MASK, batch[K.ATTENTION_MASK] & (torch.arange(12)[None] >= 2))
    local = ff.shard_batch(batch, mesh)
    messages = []
    for estimator in ("grpo", "drgrpo", "rloo"):
        try:
            ff.compute_advantages(local, ff.AdvantageConfig(estimator=estimator, group_size=4),
                                  mesh=mesh)
            messages.append(None)
        except ff.BatchError as exc:
            messages.append(str(exc))
    ok = ff.compute_advantages(ff.shard_batch(batch, mesh, group_size=4),
                               ff.AdvantageConfig(group_size=4), mesh=mesh)
    return local[K.ROW_INDEX].tolist(), messages, ok.batch_size[0]


@pytest.mark.timeout(200)
def test_a_group_split_by_shard_batch_is_refused_on_every_rank(spmd2):
    for rows, messages, n_ok in spmd2.run(split_groups_are_refused, timeout=150):
        assert rows not in ([0, 1, 2, 3], [4, 5, 6, 7]), rows    # the split did happen
        for message in messages:
            assert message is not None and "group_size=4" in message, message
            assert "shard_batch split the groups" in message, message
        assert n_ok == 4


def overflow_on_one_rank():
    """Rank 0's rewards overflow float32 after reward_scale; rank 1's do not. Every rank must
    raise (rank 1 waiting in the next collective would hang), then a sane call still runs."""
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=-1), device_type="cpu")
    batch = _global_batch(2, 2, 8, seed=3)
    rank = torch.distributed.get_rank()
    batch.set(K.REWARDS, torch.tensor([3e38, -3e38, 1.0, 2.0] if rank == 0 else [1.0, 2.0] * 2))
    messages = []
    for estimator in ESTIMATORS:
        try:
            ff.compute_advantages(batch, ff.AdvantageConfig(
                estimator=estimator, group_size=2, reward_scale=10.0), mesh=mesh)
            messages.append(None)
        except ff.BatchError as exc:
            messages.append(str(exc))
    ok = ff.compute_advantages(batch, ff.AdvantageConfig(group_size=2, reward_scale=1e-30),
                               mesh=mesh)
    return messages, bool(torch.isfinite(ok[K.ADVANTAGES]).all())


@pytest.mark.timeout(120)
def test_advantages_that_overflow_on_one_rank_raise_on_every_rank(spmd2):
    for rank, (messages, finite) in enumerate(spmd2.run(overflow_on_one_rank, timeout=90)):
        for estimator, message in zip(ESTIMATORS, messages):
            assert message is not None and "overflow float32" in message, (rank, message)
            # reinforce++ whitens over every rank's tokens: rank 1's own are NaN as well
            assert rank == 0 or estimator == "reinforce++" or "rank 0" in message, message
        assert finite


def ppo_step_stats(shard: bool):
    """One GRPO ppo_step (whitened advantages) from the same global batch with group_id."""
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=-1), device_type="cpu")
    cfg = ff.EngineConfig(model_config=tiny_qwen2_config().to_dict(), dtype="float32", seed=1,
                          optimizer=ff.OptimizerConfig(lr=1e-3))
    state = ff.shard_model(cfg, mesh)
    order = torch.randperm(16, generator=torch.Generator().manual_seed(5)).tolist()
    batch = _global_batch(4, 4, 12, seed=9, order=order).exclude(K.OLD_LOGP)
    if shard:
        batch = ff.shard_batch(batch, mesh)               # group_id keeps groups whole
    batch = ff.forward_logp(state, batch, out_key=K.OLD_LOGP)
    batch = ff.compute_advantages(batch, ff.AdvantageConfig(estimator="grpo", group_size=4,
                                                            whiten=True), mesh=mesh)
    _, stats = ff.ppo_step(state, batch, ff.PPOConfig())
    return {k: float(stats[k]) for k in ("grad_norm", "loss", "pg_loss")}


@pytest.mark.timeout(460)
def test_ppo_step_with_group_id_does_not_depend_on_dp(spmd1, spmd2):
    whole = spmd1.run(ppo_step_stats, args=(False,), timeout=200)[0]
    for sharded in spmd2.run(ppo_step_stats, args=(True,), timeout=200):
        for key, value in whole.items():
            assert abs(sharded[key] - value) <= 1e-5 * max(1.0, abs(value)), (key, sharded, whole)
