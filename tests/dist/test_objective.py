"""An algorithm as one value: grad_step and evaluate take an Objective (the loss and what it
reads), and a bare loss_fn runs exactly as the Objective with the default options; the options
are given in the Objective only (a keyword beside the loss is a TypeError)."""

from __future__ import annotations

import pytest
import torch

import fsdpfn as ff
from fsdpfn import keys as K
from fsdpfn.engine.objective import as_objective
from fsdpfn.testing import random_batch, tiny_qwen2_config

pytestmark = pytest.mark.dist


def seq_mean_nll(outputs, mb, ctx):
    mask = mb[K.LOSS_MASK]
    per_row = -torch.where(mask, outputs[K.LOGP], torch.zeros(())).sum(-1)
    return per_row.sum(), {"rows_seen": torch.tensor(float(mb[K.LOSS_MASK].shape[0]))}


def bare_loss_equals_default_objective():
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=-1), device_type="cpu")
    cfg = ff.EngineConfig(model_config=tiny_qwen2_config().to_dict(), dtype="float32",
                          optimizer=ff.OptimizerConfig(lr=1e-2), timing=False)
    batch = random_batch(8, 12, seed=3, group_size=2)
    results = []
    for loss in (ff.Objective(seq_mean_nll), seq_mean_nll):
        state = ff.shard_model(cfg, mesh)
        ev = ff.evaluate(state, batch, loss)
        state, stats = ff.grad_step(state, batch, loss, optimizer_steps=2)
        params = [p.detach().full_tensor().clone() if hasattr(p, "full_tensor")
                  else p.detach().clone() for p in state.model.parameters()]
        results.append((dict(ev.items()), dict(stats.items()), params))
    # an Objective with options runs, and its options apply (groups of 2 kept whole)
    objective = ff.Objective(seq_mean_nll, normalizer="sequences", group_size=2,
                             temperature=0.7)
    state, stats = ff.grad_step(ff.shard_model(cfg, mesh), batch, objective, optimizer_steps=2)
    refused = []
    for fn in (ff.grad_step, ff.evaluate):
        try:
            fn(state, batch, seq_mean_nll, normalizer="sequences")
        except TypeError as exc:
            refused.append(str(exc))
    return results, (float(stats["steps"]), refused)


@pytest.mark.timeout(200)
def test_a_bare_loss_runs_exactly_as_the_default_objective(spmd2):
    for a, b, (steps, refused) in [(*r[0], r[1]) for r in
                                   spmd2.run(bare_loss_equals_default_objective, timeout=150)]:
        (ev_a, st_a, p_a), (ev_b, st_b, p_b) = a, b
        assert ev_a.keys() == ev_b.keys() and st_a.keys() == st_b.keys()
        for k in ev_a:
            assert float(ev_a[k]) == float(ev_b[k]), k
        for k in st_a:
            assert float(st_a[k]) == float(st_b[k]), k
        assert all(torch.equal(x, y) for x, y in zip(p_a, p_b))
        assert steps == 2.0
        assert len(refused) == 2 and all("normalizer" in m for m in refused), refused


def test_as_objective_rules():
    fn = seq_mean_nll
    assert as_objective(fn) == ff.Objective(fn) and as_objective(fn).name == "grad_step"
    assert as_objective(fn, "evaluate").name == "evaluate"
    obj = ff.Objective(fn, name="a", normalizer="rows")
    assert as_objective(obj) is obj and as_objective(obj, "b") == ff.Objective(
        fn, name="b", normalizer="rows")
    with pytest.raises(ff.ConfigError, match=r"normalizer: must be one of .*got 'row'"):
        ff.Objective(fn, normalizer="row")
    with pytest.raises(ff.ConfigError, match=r"loss_fn: must be callable .*got int"):
        ff.Objective(3)
    with pytest.raises(ff.ConfigError, match=r"group_size: must be an integer >= 1, got 0"):
        ff.Objective(fn, group_size=0)
    with pytest.raises(TypeError):
        as_objective(obj, None, pairs=True)
