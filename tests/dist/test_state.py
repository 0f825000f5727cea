"""State safety: bad batches leave the state exactly as it was, non-finite gradients skip the
step, superseded states and parameters changed behind fsdpfn's back are detected on every rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fsdpfn as ff
from fsdpfn import keys as K
from fsdpfn.engine.state import local_tensor
from fsdpfn.testing import random_batch, tiny_qwen2_config


def _state():
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=-1), device_type="cpu")
    cfg = ff.EngineConfig(model_config=tiny_qwen2_config().to_dict(), dtype="float32",
                          optimizer=ff.OptimizerConfig(lr=1e-3))
    return ff.shard_model(cfg, mesh)


def _snapshot(state):
    params = {n: local_tensor(p).detach().clone() for n, p in state.model.named_parameters()}
    optim = {id_: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
             for id_, s in enumerate(state.optimizer.state.values())}
    return params, optim, state.version, state.step


def _same(a, b) -> bool:
    (pa, oa, va, sa), (pb, ob, vb, sb) = a, b
    return (va, sa) == (vb, sb) and pa.keys() == pb.keys() and all(
        torch.equal(pa[k], pb[k]) for k in pa) and oa.keys() == ob.keys() and all(
        all(torch.equal(torch.as_tensor(oa[i][k]), torch.as_tensor(ob[i][k])) for k in oa[i])
        for i in oa)


def _good():
    batch = random_batch(4, 10, seed=3, group_size=2)
    batch[K.OLD_LOGP] = torch.zeros(4, 10)
    batch[K.ADVANTAGES] = torch.where(batch[K.LOSS_MASK], 1.0, 0.0)
    batch[K.REF_LOGP] = torch.zeros(4, 10)
    return batch


def _bad_batches():
    def edit(fn):
        b = _good()
        fn(b)
        return b

    def nonprefix(b):
        b[K.ATTENTION_MASK][0, 1] = False

    def outside(b):
        b[K.LOSS_MASK][1, -1] = True
        b[K.ATTENTION_MASK][1, -1] = False

    def empty(b):
        b[K.LOSS_MASK][:] = False

    def at_zero(b):
        b[K.LOSS_MASK][0, 0] = True

    def bad_id(b):
        b[K.INPUT_IDS][2, 1] = 128

    def nan_logp(b):
        b[K.OLD_LOGP][0, 3] = float("nan")

    return {
        "missing old_logp": ("ppo", _good().exclude(K.OLD_LOGP)),
        "kl without ref_logp": ("ppo_kl", _good().exclude(K.REF_LOGP)),
        "wrong dtype": ("sft", edit(lambda b: b.set(K.INPUT_IDS, b[K.INPUT_IDS].int()))),
        "non-prefix attention_mask": ("sft", edit(nonprefix)),
        "loss_mask outside attention_mask": ("sft", edit(outside)),
        "empty loss_mask": ("sft", edit(empty)),
        "loss_mask at t=0": ("sft", edit(at_zero)),
        "token id out of vocabulary": ("sft", edit(bad_id)),
        "non-finite old_logp": ("ppo", edit(nan_logp)),
        "odd rows for pairs": ("dpo", _good()[:3]),
    }


GLOBAL = ("empty loss_mask",)  # bad for the global batch, not for one rank's part


def _call(kind, state, batch):
    if kind == "sft":
        return ff.sft_step(state, batch, ff.SFTConfig())
    if kind == "ppo":
        return ff.ppo_step(state, batch, ff.PPOConfig())
    if kind == "ppo_kl":
        return ff.ppo_step(state, batch, ff.PPOConfig(kl_coef=0.1))
    return ff.dpo_step(state, batch, ff.DPOConfig())


def bad_batches_leave_state_unchanged():
    state = _state()
    state, _ = ff.sft_step(state, _good(), ff.SFTConfig())  # some optimizer state to protect
    out = {}
    for name, (kind, batch) in _bad_batches().items():
        before = _snapshot(state)
        # only rank 1 gets the bad batch: the error must still be raised on every rank. No
        # loss token is bad only for the global batch (a rank's rows may all be untrained):
        # every rank gets that one
        mine = batch if dist.get_rank() == 1 or name in GLOBAL else _good()
        try:
            _call(kind, state, mine)
            out[name] = "no error"
        except ff.BatchError as exc:
            out[name] = (str(exc), _same(before, _snapshot(state)), state.is_live)
    ff.sft_step(state, _good(), ff.SFTConfig())  # still usable
    return out


@pytest.mark.timeout(300)
def test_batch_errors_leave_state_unchanged(spmd2):
    results = spmd2.run(bad_batches_leave_state_unchanged, timeout=240)
    for rank, out in enumerate(results):
        for name, res in out.items():
            assert res != "no error", f"rank {rank}: {name}"
            message, unchanged, live = res
            assert unchanged and live, f"rank {rank}: {name}"
            if rank == 0 and name not in GLOBAL:
                assert message.startswith("(raised on rank 1)"), message
    messages = {name: res[0] for name, res in results[1].items()}
    assert "old_logp" in messages["missing old_logp"]
    assert "ref_logp" in messages["kl without ref_logp"] and "kl_coef" in \
        messages["kl without ref_logp"]
    assert "int64" in messages["wrong dtype"] and "torch.int32" in messages["wrong dtype"]
    assert "128" in messages["token id out of vocabulary"]
    assert "on any of the 2 data-parallel ranks" in messages["empty loss_mask"]


def nonfinite_gradient_skips():
    state = _state()
    state, _ = ff.sft_step(state, _good(), ff.SFTConfig())
    before = _snapshot(state)

    def poisoned(outputs, mb, ctx):
        loss = -(outputs[K.LOGP] * mb[K.LOSS_MASK]).sum()
        if dist.get_rank() == 1:  # one rank's NaN must not poison anyone
            loss = loss * float("nan")
        return loss, {}

    new, stats = ff.grad_step(state, _good(), poisoned)
    after = _snapshot(new)
    same_weights = _same((before[0], before[1], 0, 0), (after[0], after[1], 0, 0))
    new2, stats2 = ff.sft_step(new, _good(), ff.SFTConfig())
    return (float(stats["skipped"]), float(stats["steps"]), same_weights,
            (before[2], before[3]), (new.version, new.step), float(stats2["skipped"]), new2.step)


@pytest.mark.timeout(200)
def test_nonfinite_gradient_skips_the_step(spmd2):
    for skipped, steps, same, before, after, skipped2, step2 in spmd2.run(
            nonfinite_gradient_skips, timeout=150):
        assert skipped == 1 and steps == 0 and same
        assert after == before  # version and step unchanged: no weights changed
        assert skipped2 == 0 and step2 == before[1] + 1


def stale_and_mutation():
    state = _state()
    batch = _good()
    new, _ = ff.sft_step(state, batch, ff.SFTConfig())
    out = {}
    for name, call in {"forward_logp": lambda s: ff.forward_logp(s, batch),
                       "sft_step": lambda s: ff.sft_step(s, batch, ff.SFTConfig()),
                       "grad_step": lambda s: ff.grad_step(s, batch, lambda o, m, c: (
                           o[K.LOGP].sum(), {}))}.items():
        try:
            call(state)
            out[name] = None
        except ff.StaleStateError as exc:
            out[name] = str(exc)
    if dist.get_rank() == 0:  # a change behind fsdpfn's back, on one rank only
        with torch.no_grad():
            local_tensor(next(new.model.parameters())).add_(1.0)
    try:
        ff.forward_logp(new, batch)
        out["mutation"] = None
    except ff.StaleStateError as exc:
        out["mutation"] = str(exc)
    return out


@pytest.mark.timeout(200)
def test_stale_state_and_outside_mutation_detected(spmd2):
    for rank, out in enumerate(spmd2.run(stale_and_mutation, timeout=150)):
        for name in ("forward_logp", "sft_step", "grad_step"):
            assert out[name] is not None and "superseded by sft_step()" in out[name]
            assert "state, stats = sft_step(state" in out[name]
        assert out["mutation"] is not None and "changed in place outside fsdpfn" in out["mutation"]


def several_steps_in_one_call():
    """ppo_step with two minibatches: the optimizer's own in-place writes between them are not
    taken for outside writes, with each optimizer the engine builds."""
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=-1), device_type="cpu")
    out = {}
    for name, extra in {"adamw": {}, "bf16 state": {"optimizer_dtype": "bfloat16"},
                        "per-layer step": {"fsdp": ff.FSDPConfig(per_layer_optim_step=True)}
                        }.items():
        cfg = ff.EngineConfig(model_config=tiny_qwen2_config().to_dict(), dtype="float32",
                              optimizer=ff.OptimizerConfig(lr=1e-3), **extra)
        state = ff.shard_model(cfg, mesh)
        batch = random_batch(8, 10, seed=3, group_size=2)
        batch[K.OLD_LOGP] = torch.zeros(8, 10)
        batch[K.ADVANTAGES] = torch.linspace(-1, 1, 80).view(8, 10)
        before = {n: local_tensor(p).detach().clone() for n, p in state.model.named_parameters()}
        new, stats = ff.ppo_step(state, batch, ff.PPOConfig(n_minibatches=2))
        ff.forward_logp(new, batch)  # the successor is live
        moved = any(not torch.equal(before[n], local_tensor(p))
                    for n, p in new.model.named_parameters())
        out[name] = (int(stats["steps"]), new.step, moved)
    return out


@pytest.mark.timeout(200)
def test_several_optimizer_steps_in_one_call(spmd2):
    for out in spmd2.run(several_steps_in_one_call, timeout=150):
        assert out == {name: (2, 2, True) for name in ("adamw", "bf16 state", "per-layer step")}
