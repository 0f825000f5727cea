"""Batch tensors are data: one that carries an autograd graph is read as its value.

A pipeline that computes advantages or old log-probs from its own model without
``torch.no_grad()`` hands the step tensors with a ``grad_fn``. The step's backward would run
into that graph: the first minibatch's backward frees it, and the second failed with torch's
"backward through the graph a second time" after the first had already stepped, the state
donated. The steps read such tensors detached, and the caller's tensors and graph are left as
they were.
"""

from __future__ import annotations

import pytest
import torch

import fsdpfn as ff
from fsdpfn import keys as K
from fsdpfn.testing import random_batch, tiny_qwen2_config, with_ppo_keys


def _state(mesh):
    cfg = ff.EngineConfig(model_config=tiny_qwen2_config().to_dict(), dtype="float32", seed=3,
                          optimizer=ff.OptimizerConfig(lr=1e-2))
    return ff.shard_model(cfg, mesh)


def _rl_batch():
    return with_ppo_keys(random_batch(6, 10, seed=0, min_len=5, prompt_len=3), seed=7)


def _with_graph(batch, keys):
    """The batch with each of ``keys`` the output of a graph ending in a leaf that wants grad."""
    out = batch.clone()
    leaves = {}
    for key in keys:
        leaves[key] = torch.ones((), requires_grad=True)
        out[key] = batch[key] * leaves[key]
        assert out[key].grad_fn is not None
    return out, leaves


def _weights(state):
    return {k: v.detach().clone() for k, v in state.model.state_dict().items()}


@pytest.mark.parametrize("n_minibatches", [1, 3])
def test_a_batch_with_a_graph_steps_as_its_detached_values(n_minibatches):
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=-1), device_type="cpu")
    plain = _rl_batch()
    keys = [K.OLD_LOGP, K.REF_LOGP, K.ADVANTAGES]
    graphed, leaves = _with_graph(plain, keys)
    before = {k: graphed[k].detach().clone() for k in keys}

    def run(batch):
        state = _state(mesh)
        cfg = ff.PPOConfig(n_minibatches=n_minibatches, kl_coef=0.1, kl_kind="k3")
        state, stats = ff.ppo_step(state, batch, cfg)
        return _weights(state), stats

    want_w, want_stats = run(plain)
    got_w, got_stats = run(graphed)
    for name in want_w:
        assert torch.equal(got_w[name], want_w[name]), name
    for key in want_stats.keys():
        if not key.startswith("time_") and key not in ("peak_memory_gb", "tokens_per_s", "mfu"):
            assert torch.equal(got_stats[key], want_stats[key]), key
    # the caller's tensors and graph are untouched: same values, still in their graph, no grad
    for key in keys:
        assert graphed[key].grad_fn is not None and torch.equal(graphed[key].detach(), before[key])
    assert all(leaf.grad is None for leaf in leaves.values())
