"""Several minibatches a call do not depend on how rows are spread over data-parallel ranks:
they are cut from the global batch (row_index order after shard_batch, else dp-rank order), so
dp=2 with any spread (shard_batch's, or one row on one rank and the rest on the other, at
different padded widths) takes the optimizer steps of dp=1 on the whole batch. A minibatch that
leaves a rank without rows still agrees on its stats; fewer rows than minibatches is refused
before any step; an error after a step hands the successor state over."""

from __future__ import annotations

import pytest
import torch

import fsdpfn as ff
from fsdpfn import keys as K
from fsdpfn.engine import timing
from fsdpfn.testing import random_batch, tiny_qwen2_config

B, T = 7, 12


def _state(lr=1e-2, tp=1):
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=-1, tp=tp), device_type="cpu")
    cfg = ff.EngineConfig(model_config=tiny_qwen2_config().to_dict(), dtype="float32", seed=1,
                          optimizer=ff.OptimizerConfig(lr=lr))
    return ff.shard_model(cfg, mesh)


def _global_batch(state, rows=B):
    batch = random_batch(rows, T, seed=11, min_len=4)
    batch = ff.forward_logp(state, batch, out_key=K.OLD_LOGP)
    adv = torch.randn(rows, T, generator=torch.Generator().manual_seed(5))
    return batch.copy().set(K.ADVANTAGES, torch.where(batch[K.LOSS_MASK], adv, torch.zeros(())))


def _spread(batch, mesh, how):
    """This rank's rows: all of them (dp=1), shard_batch's, or row 0 alone on rank 0 and the
    others on rank 1, each cut to its own widest row."""
    if mesh.dp == 1:
        return batch
    if how == "shard":
        return ff.shard_batch(batch, mesh)
    rows = [0] if mesh.rank("dp") == 0 else list(range(1, batch.batch_size[0]))
    part = batch[torch.tensor(rows)]
    width = int(part[K.ATTENTION_MASK].sum(-1).max())
    return part.apply(lambda x: x[:, :width] if x.ndim == 2 else x)


def _stat_loss(outputs, minibatch, ctx):
    """A token-sum loss with a sum stat and a max stat (the max of each row's first log-prob)."""
    mask = minibatch[K.LOSS_MASK]
    logp = torch.where(mask, outputs[K.LOGP], torch.zeros(()))
    first = logp[:, :].sum(-1)
    return -(logp * minibatch[K.ADVANTAGES]).sum(), {"rows_seen": torch.tensor(float(len(first))),
                                                     "row_logp_max": first.max().detach()}


def steps_under(how):
    """Each case from a fresh state; returns (stats, per-row log-prob sums after) per case."""
    out = []
    cases = [("ppo", ff.PPOConfig(clip_low=0.2, n_minibatches=3), B),
             ("ppo", ff.PPOConfig(clip_low=0.2, n_minibatches=2, shuffle=True, seed=5,
                                  agg="seq-mean-token-mean"), B),
             ("grad", 3, 3)]  # three rows, three minibatches: at dp=2 one rank has none each time
    for kind, config, rows in cases:
        state = _state()
        whole = _global_batch(state, rows)
        mine = _spread(whole, state.mesh, how)
        if kind == "ppo":
            state, stats = ff.ppo_step(state, mine, config)
        else:
            state, stats = ff.grad_step(state, mine, ff.Objective(_stat_loss, normalizer="rows"),
                                        optimizer_steps=config)
        after = ff.forward_logp(state, whole)[K.LOGP].sum(-1)
        out.append(({k: float(v) for k, v in stats.items() if k not in timing.KEYS},
                    after.tolist(), state.step))
    return out


@pytest.mark.timeout(540)
@pytest.mark.parametrize("how", ["shard", "uneven"])
def test_several_minibatches_equal_dp1_whatever_the_spread(spmd1, spmd2, how):
    one = spmd1.run(steps_under, args=(how,), timeout=240)[0]
    two = spmd2.run(steps_under, args=(how,), timeout=240)
    assert two[0] == two[1]  # identical on all ranks
    for case, ((s1, after1, step1), (s2, after2, step2)) in enumerate(zip(one, two[0])):
        assert set(s1) == set(s2) and step1 == step2 == s1["steps"], (case, set(s1) ^ set(s2))
        for key in s1:
            assert abs(s1[key] - s2[key]) <= 1e-5 * max(1.0, abs(s1[key])), \
                (case, key, s1[key], s2[key])
        assert torch.allclose(torch.tensor(after1), torch.tensor(after2), rtol=1e-5, atol=1e-5), \
            (case, after1, after2)
    # the grad case's stats: every row seen once over the three minibatches (mean of 1 each)
    assert one[2][0]["rows_seen"] == 1.0 and one[2][0]["steps"] == 3.0


def refusals():
    """Fewer rows than minibatches, globally: refused before any step, the state still live."""
    state = _state()
    whole = _global_batch(state, 3)
    mine = _spread(whole, state.mesh, "uneven")
    try:
        ff.ppo_step(state, mine, ff.PPOConfig(n_minibatches=4))
        message = None
    except ff.BatchError as exc:
        message = str(exc)
    state, stats = ff.ppo_step(state, mine, ff.PPOConfig(n_minibatches=3))  # still usable
    return message, state.step


@pytest.mark.timeout(200)
def test_fewer_rows_than_minibatches_is_refused_on_every_rank(spmd2):
    for message, step in spmd2.run(refusals, timeout=150):
        assert message is not None and "ppo_step takes 4 optimizer steps" in message \
            and "at least 4 rows" in message and "got 3" in message, message
        assert step == 3


def failing_later():
    """A loss_fn that fails on the second minibatch: the first step stands, and the error
    carries the successor state; the state passed in is donated."""
    state = _state()
    whole = _global_batch(state, 4)

    def loss(outputs, minibatch, ctx):
        if ctx.minibatch == 1:
            raise ValueError("bad minibatch")
        return -(outputs[K.LOGP] * minibatch[K.LOSS_MASK]).sum(), {}

    try:
        ff.grad_step(state, whole, loss, optimizer_steps=2)
    except ValueError as exc:
        successor, notes = exc.state, getattr(exc, "__notes__", [])
    try:
        ff.forward_logp(state, whole)
        stale = None
    except ff.StaleStateError as exc:
        stale = str(exc)
    return successor.step, successor.version, notes, stale, ff.forward_logp(successor, whole)


@pytest.mark.timeout(200)
def test_an_error_after_a_step_hands_over_the_successor(spmd1):
    step, version, notes, stale, batch = spmd1.run(failing_later, timeout=150)[0]
    assert (step, version) == (1, 1)
    assert any("1 optimizer step(s) of this call had run" in n and ".state" in n for n in notes)
    assert stale is not None and "grad_step" in stale
    assert K.LOGP in batch.keys()


def orders():
    """order= as a list or an int tensor (the same steps); a wrong one refused, state kept."""
    results, errors = [], []
    for order in ([2, 0, 3, 1], torch.tensor([2, 0, 3, 1])):
        state = _state()
        state, stats = ff.grad_step(state, _global_batch(state, 4), _stat_loss,
                                    optimizer_steps=2, order=order)
        results.append(ff.forward_logp(state, _global_batch(state, 4))[K.LOGP])
    state = _state()
    for order, kwargs in (([0, 1, 1, 2], {}), ("0123", {}), ([0, 1, 2, 3], {"shuffle_seed": 1})):
        try:
            ff.grad_step(state, _global_batch(state, 4), _stat_loss, optimizer_steps=2,
                         order=order, **kwargs)
        except ff.ConfigError as exc:
            errors.append(str(exc))
    return results, errors, state.step


@pytest.mark.timeout(200)
def test_order_as_a_list_or_a_tensor_and_refused_when_wrong(spmd1):
    (by_list, by_tensor), errors, step = spmd1.run(orders, timeout=150)[0]
    assert torch.equal(by_list, by_tensor)
    assert len(errors) == 3 and step == 0, errors
    assert "must be a permutation of the global batch's 4 rows" in errors[0]
    assert "must be a sequence of unit indices" in errors[1]
    assert "give order or shuffle_seed, not both" in errors[2]


def shuffled_ppo(tp):
    """Three shuffled minibatches of the uneven spread; dp=2 x tp=2: each dp group gathers the
    same global batch, the tp peers of a dp rank run the same rows."""
    state = _state(tp=tp)
    whole = _global_batch(state)
    config = ff.PPOConfig(clip_low=0.2, n_minibatches=3, shuffle=True, seed=2)
    state, stats = ff.ppo_step(state, _spread(whole, state.mesh, "uneven"), config)
    return float(stats["loss"]), ff.forward_logp(state, whole)[K.LOGP].sum(-1)


@pytest.mark.timeout(540)
def test_several_minibatches_at_dp2_tp2_equal_dp1(spmd1, spmd4):
    loss1, after1 = spmd1.run(shuffled_ppo, args=(1,), timeout=240)[0]
    four = spmd4.run(shuffled_ppo, args=(2,), timeout=240)
    for loss, after in four:
        assert abs(loss - loss1) <= 1e-5 * max(1.0, abs(loss1)), (loss, loss1)
        assert torch.allclose(after, after1, rtol=1e-5, atol=1e-5), (after, after1)
