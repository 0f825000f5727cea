"""A data-parallel rank whose rows have no loss token trains with the others.

Losses are normalised over the global batch, so a rank's own part may hold only untrained rows
(rows masked out whole, such as overlong samples, can land on one rank, and shard_batch may put
them there). The check "loss_mask has at least one True" used to run on each rank's rows and
refused such a batch at dp=2 that one rank accepts. It now counts the global batch: the step at
dp=2 equals a float64 reference of the whole batch, and a global batch with no loss token at all
is still refused, on every rank, with the state usable afterwards.
"""

from __future__ import annotations

import pytest
import torch

import fsdpfn as ff
from fsdpfn import keys as K
from fsdpfn.testing import random_batch, tiny_qwen2_config
from fsdpfn.testing.models import full_model_state

pytestmark = pytest.mark.dist


def _state():
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=-1), device_type="cpu")
    # Adam with betas 0 and eps 1: each parameter moves by -g / (|g| + 1), written out below
    opt = ff.OptimizerConfig(lr=1.0, eps=1.0, betas=(0.0, 0.0), weight_decay=0.0,
                             max_grad_norm=None)
    cfg = ff.EngineConfig(model_config=tiny_qwen2_config().to_dict(), dtype="float32", seed=2,
                          optimizer=opt)
    return ff.shard_model(cfg, mesh), mesh


def _global_batch(trained: bool = True):
    batch = random_batch(4, 12, seed=7, min_len=6)
    loss = torch.zeros_like(batch[K.LOSS_MASK])
    if trained:  # row 0 alone is trained on
        loss[0] = batch[K.LOSS_MASK][0]
    return batch.set(K.LOSS_MASK, loss)


def _mine(batch, mesh):
    """Rows 0, 1 on dp rank 0 and rows 2, 3 on dp rank 1: rank 1 holds no loss token."""
    rows = torch.arange(4).view(mesh.dp, -1)[mesh.rank("dp")] if mesh.dp > 1 else torch.arange(4)
    return batch[rows]


def _reference(weights, batch):
    """Float64: the SFT loss (-token-mean of logp over the global batch) and the weights after
    one step of the Adam above, from the HF model's own forward."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tiny_qwen2_config(), dtype=torch.float64,
                                             attn_implementation="eager")
    model.load_state_dict({k: v.double() for k, v in weights.items()})
    ids, attn, mask = batch[K.INPUT_IDS], batch[K.ATTENTION_MASK], batch[K.LOSS_MASK]
    logits = model(input_ids=ids, attention_mask=attn.long(), use_cache=False).logits
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    loss = -(lp * mask[:, 1:]).sum() / mask.sum()
    loss.backward()
    after = {n: (p - p.grad / (p.grad.abs() + 1.0)).detach() if p.grad is not None else p.detach()
             for n, p in model.named_parameters()}
    return float(loss), after


def untrained_rank():
    state, mesh = _state()
    before = full_model_state(state)
    batch = _global_batch()
    local = _mine(batch, mesh)
    out = {"local_tokens": int(local[K.LOSS_MASK].sum())}
    advantages = ff.compute_advantages(
        local.set(K.REWARDS, torch.linspace(1.0, 0.0, local.batch_size[0])),
        ff.AdvantageConfig(estimator="reinforce++"), mesh=mesh)
    out["advantages_finite"] = bool(torch.isfinite(advantages[K.ADVANTAGES]).all())
    out["eval_loss"] = float(ff.evaluate(state, local, ff.algos.sft.sft_objective(
        ff.SFTConfig()))["loss"])
    state, stats = ff.sft_step(state, local, ff.SFTConfig())
    after = full_model_state(state)  # the full weights on rank 0, nothing on the others
    out.update(loss=float(stats["loss"]), tokens=float(stats["tokens"]))
    if before:
        loss64, after64 = _reference(before, batch)
        out.update(loss64=loss64, weights_diff=max(
            float((after[n].double() - after64[n]).abs().max()) for n in after64))

    # no loss token anywhere: refused on every rank, the state usable afterwards
    empty = _mine(_global_batch(trained=False), mesh)
    try:
        ff.sft_step(state, empty, ff.SFTConfig())
        out["empty_error"] = None
    except ff.BatchError as exc:
        out["empty_error"] = str(exc)
    state, stats = ff.sft_step(state, local, ff.SFTConfig())
    out["after_error_steps"] = float(stats["steps"])
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [1, 2])
def test_a_rank_without_loss_tokens_trains_with_the_global_batch(world, spmd1, spmd2):
    results = (spmd1 if world == 1 else spmd2).run(untrained_rank, timeout=200)
    if world == 2:
        assert [r["local_tokens"] for r in results] != [0, 0] and \
            min(r["local_tokens"] for r in results) == 0, results
    loss64 = results[0]["loss64"]
    assert results[0]["weights_diff"] <= 1e-4, results[0]
    for r in results:
        assert r["advantages_finite"], r
        assert abs(r["loss"] - loss64) <= 1e-5 * abs(loss64), (r, loss64)
        assert abs(r["eval_loss"] - loss64) <= 1e-5 * abs(loss64), (r, loss64)
        assert r["tokens"] == results[0]["tokens"] > 0, r
        message = r["empty_error"]
        assert message is not None and message.startswith(
            "loss_mask: must have at least one True, got none"), message
        if world == 2:
            assert "on any of the 2 data-parallel ranks" in message, message
        assert r["after_error_steps"] == 1.0, r
