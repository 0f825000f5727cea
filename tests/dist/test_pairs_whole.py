"""Pairs (row 2i chosen, 2i+1 rejected) stay whole wherever rows are moved.

- A custom ``Objective(pairs=True)`` (group_size left at 1) had its pairs cut by micro-batches
  (a wrong loss, or a shape error with ``n_mbs=3``) and by minibatches (a row-level ``order``
  was accepted and could swap chosen and rejected). Its unit is now the pair: the loss equals a
  float64 reference of the same weights under any micro-batching, and ``order`` orders pairs.
- ``shard_batch(batch, mesh)``, the contract's call, split pairs across ranks at dp=2 and
  ``rw_step`` / ``dpo_step`` trained on rows that were never a pair. It keeps them whole by
  default now, so the pair steps at dp=2 equal one rank's; a batch sharded row by row
  (``group_size=1``) is refused by the pair steps, naming ``row_index``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fsdpfn as ff
from fsdpfn import keys as K
from fsdpfn.errors import BatchError, ConfigError
from fsdpfn.testing import random_batch, tiny_qwen2_config
from fsdpfn.testing.models import full_model_state

pytestmark = pytest.mark.dist


def _state(*, critic=False, optimizer=True):
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=-1), device_type="cpu")
    # Adam with betas 0 and eps 1: each parameter moves by -g / (|g| + 1), written out below
    opt = ff.OptimizerConfig(lr=1.0, eps=1.0, betas=(0.0, 0.0), weight_decay=0.0,
                             max_grad_norm=None) if optimizer else None
    cfg = ff.EngineConfig(model_config=tiny_qwen2_config().to_dict(), dtype="float32",
                          is_critic=critic, seed=1, optimizer=opt)
    return ff.shard_model(cfg, mesh), mesh


def _hf64(state):
    from transformers import AutoModelForCausalLM

    weights = full_model_state(state)
    model = AutoModelForCausalLM.from_config(tiny_qwen2_config(), dtype=torch.float64,
                                             attn_implementation="eager")
    model.load_state_dict({k: v.double() for k, v in weights.items()})
    return model.eval()


def _logp64(model, batch):
    ids, attn = batch[K.INPUT_IDS], batch[K.ATTENTION_MASK]
    logits = model(input_ids=ids, attention_mask=attn.long(), use_cache=False).logits
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    lp = torch.cat([torch.zeros_like(lp[:, :1]), lp], 1)
    return torch.where(attn, lp, torch.zeros((), dtype=lp.dtype))


def _pair_loss(outputs, mb, ctx):
    """-log sigmoid(0.1 (seq logp(chosen) - seq logp(rejected))) summed over the pairs."""
    mask = mb[K.LOSS_MASK]
    seq = torch.where(mask, outputs[K.LOGP], torch.zeros((), device=mask.device)).sum(-1)
    seq = seq.view(-1, 2)
    return (-F.logsigmoid(0.1 * (seq[:, 0] - seq[:, 1]))).sum(), {}


def _pair_loss64(model, batch):
    seq = (_logp64(model, batch) * batch[K.LOSS_MASK]).sum(-1).view(-1, 2)
    return (-F.logsigmoid(0.1 * (seq[:, 0] - seq[:, 1]))).mean()


OBJECTIVE = ff.Objective(_pair_loss, normalizer="pairs", pairs=True)


def _micro_batches():
    state, _ = _state()
    batch = random_batch(8, 12, seed=41)
    want = float(_pair_loss64(_hf64(state), batch))
    pair_tokens = batch[K.ATTENTION_MASK].sum(-1).view(-1, 2).sum(-1)
    specs = {"n_mbs=3": ff.MicroBatchSpec(n_mbs=3),
             "a budget of the longest pair": ff.MicroBatchSpec(
                 max_tokens_per_mb=int(pair_tokens.max()))}
    got = {name: float(ff.evaluate(state, batch, OBJECTIVE, mb_spec=spec)["loss"])
           for name, spec in specs.items()}
    return want, got


@pytest.mark.timeout(180)
def test_a_pair_objective_keeps_its_pairs_whole_in_micro_batches(spmd1):
    want, got = spmd1.run(_micro_batches, timeout=150)[0]
    for name, value in got.items():
        assert abs(value - want) < 1e-5, (name, value, want)


def _minibatches():
    state, _ = _state()
    batch = random_batch(8, 12, seed=41)
    model = _hf64(state)
    try:
        ff.grad_step(state, batch, OBJECTIVE, optimizer_steps=2, order=[0, 2, 1, 3, 4, 6, 5, 7])
        refused = None
    except ConfigError as exc:  # a row order: 8 entries for 4 pairs
        refused = str(exc)
    new, stats = ff.grad_step(state, batch, OBJECTIVE, optimizer_steps=2, order=[1, 0, 3, 2])
    losses = []
    for rows in ([2, 3, 0, 1], [6, 7, 4, 5]):  # pairs 1, 0 then pairs 3, 2
        model.zero_grad()
        loss = _pair_loss64(model, batch[torch.tensor(rows)])
        loss.backward()
        losses.append(float(loss))
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p -= p.grad / (p.grad.abs() + 1)
    after = {k: v.double() for k, v in full_model_state(new).items()}
    gap = max(float((after[k] - v).abs().max()) for k, v in model.state_dict().items()
              if k in after)
    return refused, float(stats["loss"]), sum(losses) / 2, gap


@pytest.mark.timeout(180)
def test_a_pair_objectives_minibatches_are_cut_and_ordered_by_pairs(spmd1):
    refused, loss, want, gap = spmd1.run(_minibatches, timeout=150)[0]
    assert refused is not None and "order: must be a permutation of the global batch's 4 " \
        "units of 2 rows" in refused, refused
    assert abs(loss - want) < 1e-5 and gap < 1e-5, (loss, want, gap)


def _pair_steps(group_size):
    out = {}
    for name in ("rw", "dpo"):
        state, mesh = _state(critic=name == "rw")
        batch = random_batch(8, 12, seed=9)
        if name == "dpo":
            ref, _ = _state(optimizer=False)
            batch = ff.forward_logp(ref, batch, out_key=K.REF_LOGP)
        local = (ff.shard_batch(batch, mesh) if group_size is None
                 else ff.shard_batch(batch, mesh, group_size=group_size))
        try:
            step = ff.rw_step if name == "rw" else ff.dpo_step
            config = ff.RWConfig() if name == "rw" else ff.DPOConfig(beta=0.1)
            _, stats = step(state, local, config)
            out[name] = {k: float(v) for k, v in stats.items()}
        except BatchError as exc:
            out[name] = str(exc)
    return out


@pytest.mark.timeout(300)
def test_pair_steps_after_the_default_shard_batch_equal_one_rank(spmd1, spmd2):
    one = spmd1.run(_pair_steps, args=(None,), timeout=150)[0]
    two = spmd2.run(_pair_steps, args=(None,), timeout=150)
    for name in ("rw", "dpo"):
        for key in ("loss", "accuracy" if name == "rw" else "reward_accuracy", "margin"):
            for rank in two:
                assert abs(rank[name][key] - one[name][key]) < 1e-5, (name, key, rank, one)
    split = spmd2.run(_pair_steps, args=(1,), timeout=150)
    for rank in split:
        for name in ("rw", "dpo"):
            assert isinstance(rank[name], str) and rank[name].startswith(
                "row_index: pair ") and "split the pairs" in rank[name], rank[name]
