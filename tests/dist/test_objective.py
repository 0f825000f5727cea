"""An algorithm as one value: grad_step and evaluate take an Objective (the loss and what it
reads) exactly as they take a loss_fn with keywords; options given twice are refused."""

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


def objective_equals_keywords():
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=-1), device_type="cpu")
    cfg = ff.EngineConfig(model_config=tiny_qwen2_config().to_dict(), dtype="float32",
                          optimizer=ff.OptimizerConfig(lr=1e-2), timing=False)
    batch = random_batch(8, 12, seed=3, group_size=2)
    objective = ff.Objective(seq_mean_nll, normalizer="sequences", group_size=2,
                             temperature=0.7)
    results = []
    for loss in ("objective", "keywords"):
        state = ff.shard_model(cfg, mesh)
        if loss == "objective":
            ev = ff.evaluate(state, batch, objective)
            state, stats = ff.grad_step(state, batch, objective, optimizer_steps=2)
        else:
            ev = ff.evaluate(state, batch, seq_mean_nll, normalizer="sequences", group_size=2,
                             temperature=0.7)
            state, stats = ff.grad_step(state, batch, seq_mean_nll, optimizer_steps=2,
                                        normalizer="sequences", group_size=2, temperature=0.7)
        params = [p.detach().full_tensor().clone() if hasattr(p, "full_tensor")
                  else p.detach().clone() for p in state.model.parameters()]
        results.append((dict(ev.items()), dict(stats.items()), params))
    state = ff.shard_model(cfg, mesh)
    try:
        ff.grad_step(state, batch, objective, normalizer="tokens", group_size=4)
        mixed = None
    except ff.ConfigError as exc:
        mixed = str(exc)
    return results, mixed


@pytest.mark.timeout(200)
def test_objective_runs_exactly_as_the_keywords_do(spmd2):
    for (a, b), mixed in [(r[0], r[1]) for r in spmd2.run(objective_equals_keywords, timeout=150)]:
        (ev_a, st_a, p_a), (ev_b, st_b, p_b) = a, b
        assert ev_a.keys() == ev_b.keys() and st_a.keys() == st_b.keys()
        for k in ev_a:
            assert float(ev_a[k]) == float(ev_b[k]), k
        for k in st_a:
            assert float(st_a[k]) == float(st_b[k]), k
        assert all(torch.equal(x, y) for x, y in zip(p_a, p_b))
        assert mixed == "group_size: set it in the Objective, not beside it, got 4"


def test_as_objective_rules():
    fn = seq_mean_nll
    assert as_objective(fn, None).name == "grad_step"
    assert as_objective(fn, "my_step", normalizer="rows").normalizer == "rows"
    obj = ff.Objective(fn, name="a")
    assert as_objective(obj, None) is obj and as_objective(obj, "b").name == "b"
    with pytest.raises(ff.ConfigError, match=r"normalizer: must be one of .*got 'row'"):
        ff.Objective(fn, normalizer="row")
    with pytest.raises(ff.ConfigError, match=r"loss_fn: must be callable .*got int"):
        ff.Objective(3)
    with pytest.raises(ff.ConfigError, match=r"group_size: must be an integer >= 1, got 0"):
        ff.Objective(fn, group_size=0)
    with pytest.raises(ff.ConfigError, match=r"pairs: set it in the Objective"):
        as_objective(obj, None, pairs=True)
