"""Bad input on one rank only: every rank raises the same typed error, none is left waiting.

SPMD: every rank runs the same call. When one rank's call differs (its loss_fn fails, returns
something else, reports other stat names; its batch lacks a key; its config, checkpoint path or
global batch differs), the ranks used to take different collectives: one raised while the
others waited in the backward's reduce-scatter or the stats all-reduce (a hang), gloo aborted a
process, stats came back mislabelled, or a checkpoint missing rank 1's shard was published as
complete. Each case now ends in one typed error on every rank, and the state stays usable: a
valid step after it equals the same step from a state that never saw the failed call.
"""

from __future__ import annotations

import os

import attrs
import pytest
import torch
import torch.distributed as dist

import fsdpfn as ff
from fsdpfn import keys as K
from fsdpfn.testing import random_batch, tiny_qwen2_config
from fsdpfn.testing.models import full_model_state

pytestmark = pytest.mark.dist


def _state(mesh):
    cfg = ff.EngineConfig(model_config=tiny_qwen2_config().to_dict(), dtype="float32", seed=2,
                          optimizer=ff.OptimizerConfig(lr=1e-2, weight_decay=0.0))
    return ff.shard_model(cfg, mesh)


def _local_batch(mesh):
    batch = random_batch(4, 12, seed=7, min_len=6)
    me = mesh.rank("dp")
    local = batch[2 * me:2 * me + 2]
    lm, attn = local[K.LOSS_MASK], local[K.ATTENTION_MASK]
    gen = torch.Generator().manual_seed(11 + me)
    local.set(K.OLD_LOGP, torch.where(attn & (torch.arange(12) > 0), -3.0, 0.0))
    local.set(K.ADVANTAGES, torch.where(lm, torch.randn(lm.shape, generator=gen), 0.0))
    return local


def _loss_fn(mode: str, odd: bool):
    def loss_fn(outputs, mb, ctx):
        loss = -(outputs[K.LOGP] * mb[K.LOSS_MASK]).sum()
        stats = {"nll": loss.detach()}
        if odd and mode == "raise":
            raise RuntimeError("this rank's loss_fn failed")
        if odd and mode == "float":
            return float(loss), stats
        if odd and mode == "names":
            stats = {"other": loss.detach()}
        if odd and mode == "more":
            stats["extra"] = loss.detach()
        return loss, stats
    return loss_fn


def _outcome(call) -> tuple[str, str]:
    try:
        call()
        return "accepted", ""
    except Exception as exc:  # noqa: BLE001 - the outcome is what the test compares
        return type(exc).__name__, str(exc)


def one_rank_differs(root: str) -> dict:
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=2), device_type="cpu")
    odd = mesh.rank("dp") == 1
    state, batch = _state(mesh), _local_batch(mesh)
    out = {}
    cases = {
        "raise": lambda: ff.grad_step(state, batch.clone(), _loss_fn("raise", odd)),
        "float": lambda: ff.grad_step(state, batch.clone(), _loss_fn("float", odd)),
        "names": lambda: ff.grad_step(state, batch.clone(), _loss_fn("names", odd)),
        "more": lambda: ff.grad_step(state, batch.clone(), _loss_fn("more", odd)),
        "evaluate": lambda: ff.evaluate(state, batch.clone(), _loss_fn("raise", odd)),
        "behav_key": lambda: ff.ppo_step(state, batch.clone().set(
            K.BEHAV_LOGP, batch[K.OLD_LOGP].clone()) if not odd else batch.clone(),
            ff.PPOConfig()),
        "n_minibatches": lambda: ff.ppo_step(state, batch.clone(),
                                             ff.PPOConfig(n_minibatches=2 if odd else 1)),
        "advantages": lambda: ff.compute_advantages(
            batch.clone().set(K.REWARDS, torch.ones(2)),
            ff.AdvantageConfig(estimator="grpo", group_size=2, whiten=False) if odd
            else ff.AdvantageConfig(estimator="reinforce++"), mesh=mesh),
        "save_path": lambda: ff.save_checkpoint(state, os.path.join(root, f"ck_{dist.get_rank()}")),
        "shard_batch": lambda: ff.shard_batch(
            random_batch(6, 12, seed=3, min_len=6).exclude(K.ATTENTION_MASK) if odd
            else random_batch(6, 12, seed=3, min_len=6), mesh),
        # gather_batch of parts with another key, or a key of another dtype, on one rank
        "gather_key": lambda: ff.gather_batch(
            batch.clone().set("extra", torch.zeros(2)) if odd else batch.clone(), mesh),
        "gather_dtype": lambda: ff.gather_batch(
            batch.clone().set(K.ADVANTAGES, batch[K.ADVANTAGES].double()) if odd
            else batch.clone(), mesh),
    }
    for name, call in cases.items():
        out[name] = _outcome(call)
    dist.barrier()
    out["listing"] = sorted(os.listdir(root))
    # the state that saw every failed call trains as a fresh one does
    state, _ = ff.sft_step(state, batch, ff.SFTConfig())
    fresh, _ = ff.sft_step(_state(mesh), batch, ff.SFTConfig())
    mine, theirs = full_model_state(state), full_model_state(fresh)
    out["weights_equal"] = all(torch.equal(mine[k], theirs[k]) for k in theirs)
    return out


EXPECTED = {"raise": "RuntimeError", "float": "ConfigError", "names": "ConfigError",
            "more": "ConfigError", "evaluate": "RuntimeError", "behav_key": "BatchError",
            "n_minibatches": "ConfigError", "advantages": "ConfigError",
            "save_path": "CheckpointError", "shard_batch": "BatchError",
            "gather_key": "BatchError", "gather_dtype": "BatchError"}


@pytest.mark.timeout(240)
def test_a_call_that_differs_on_one_rank_raises_on_every_rank(spmd2, tmp_path):
    results = spmd2.run(one_rank_differs, args=(str(tmp_path),), timeout=180)
    for name, kind in EXPECTED.items():
        got = [r[name] for r in results]
        assert [g[0] for g in got] == [kind, kind], (name, got)
    raised = [r["raise"][1] for r in results]
    assert raised[1] == "this rank's loss_fn failed", raised
    assert "loss_fn failed on rank 1" in raised[0] and "this rank's loss_fn failed" in raised[0]
    for name, fragment in (("names", "must return the same stat names on every rank"),
                           ("n_minibatches", "PPOConfig.n_minibatches"),
                           ("advantages", "AdvantageConfig.estimator"),
                           ("save_path", "path"), ("behav_key", "batch keys"),
                           ("gather_key", "rank 1 has ['extra'] and lacks []"),
                           ("gather_dtype", "advantages: every data-parallel rank must pass "
                                            "gather_batch the same dtype")):
        for r in results:
            assert fragment in r[name][1], (name, r[name])
    assert "'reinforce++' on rank 0" in results[0]["advantages"][1], results[0]["advantages"]
    # nothing was published: no checkpoint directory, no temporary one left behind
    assert results[0]["listing"] == [], results[0]["listing"]
    assert results[0]["weights_equal"] is True


@attrs.frozen
class _LossSettings:
    keys: frozenset = frozenset(f"key_{i}" for i in range(12))  # iterates in the hash seed's order
    device: object = None  # the rank's own device: the same setting on every rank


def equal_settings_and_differing_arguments(root: str) -> dict:
    """Equal settings whose repr differs by process are one call; arguments that differ by rank
    in load_checkpoint, push_weights and forward_logp (at tp=2) are an error on every rank."""
    out = {}
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=2), device_type="cpu")
    odd = mesh.rank("dp") == 1
    state, batch = _state(mesh), _local_batch(mesh)
    objective = ff.Objective(_loss_fn("none", odd), config=_LossSettings(
        device=torch.device("cuda", dist.get_rank())), require={K.LOSS_MASK, K.INPUT_IDS,
                                                                K.ATTENTION_MASK, K.ADVANTAGES})
    out["equal settings"] = _outcome(lambda: ff.grad_step(state, batch, objective))
    state = ff.shard_model(ff.EngineConfig(model_config=tiny_qwen2_config().to_dict(),
                                           dtype="float32", seed=2), mesh)  # the stepped one
    ff.save_checkpoint(state, os.path.join(root, "a"))
    ff.save_checkpoint(state, os.path.join(root, "b"))
    out["load verify"] = _outcome(lambda: ff.load_checkpoint(
        state, os.path.join(root, "a"), verify=not odd))
    out["load path"] = _outcome(lambda: ff.load_checkpoint(
        state, os.path.join(root, "b" if odd else "a")))
    out["push bucket"] = _outcome(lambda: ff.push_weights(state, ff.DiskTarget(
        os.path.join(root, "push"), bucket_bytes=1 << (10 if odd else 20))))
    tp = ff.build_mesh(ff.ParallelStrategy(dp=1, tp=2), device_type="cpu")
    actor = ff.shard_model(ff.EngineConfig(model_config=tiny_qwen2_config().to_dict(),
                                           dtype="float32", seed=2, optimizer=None), tp)
    whole = random_batch(2, 12, seed=7, min_len=6)
    out["tp temperature"] = _outcome(lambda: ff.forward_logp(actor, whole,
                                                             temperature=0.5 if odd else 1.0))
    out["tp entropy"] = _outcome(lambda: ff.forward_logp(actor, whole, with_entropy=odd))
    out["tp same"] = _outcome(lambda: ff.forward_logp(actor, whole, temperature=0.5))
    return out


@pytest.mark.timeout(240)
def test_equal_settings_pass_and_differing_arguments_raise_on_every_rank(spmd2, tmp_path):
    results = spmd2.run(equal_settings_and_differing_arguments, args=(str(tmp_path),),
                        timeout=180)
    expected = {"equal settings": "accepted", "load verify": "CheckpointError",
                "load path": "CheckpointError", "push bucket": "ConfigError",
                "tp temperature": "ConfigError", "tp entropy": "ConfigError",
                "tp same": "accepted"}
    for name, kind in expected.items():
        got = [r[name] for r in results]
        assert [g[0] for g in got] == [kind, kind], (name, got)
    assert "verify" in results[0]["load verify"][1], results[0]["load verify"]
    assert "target.bucket_bytes" in results[0]["push bucket"][1], results[0]["push bucket"]
    assert "temperature" in results[0]["tp temperature"][1], results[0]["tp temperature"]


def verdicts() -> dict:
    """fsdpfn.agree.verdict, the primitive every check above is built on."""
    from fsdpfn.agree import agree_on_error_in_group, verdict

    odd = dist.get_rank() == 1

    class LocalError(Exception):
        """Defined in a function: the class itself does not pickle."""

    return {"local": _outcome(lambda: agree_on_error_in_group(
                None, LocalError("odd rank's own") if odd else None)),
            "builtin": _outcome(lambda: verdict(KeyError("k") if odd else None)),
            "ours": _outcome(lambda: verdict(ff.BatchError("b") if odd else None)),
            "unicode": _outcome(lambda: verdict(
                UnicodeDecodeError("utf-8", b"\xff", 0, 1, "bad") if odd else None)),
            "values": verdict(None, {"n": 2 if odd else 1, "same": [1, 2]}),
            "equal": verdict(None, {"n": 1, "set": {f"k{i}" for i in range(9)}})}


@pytest.mark.timeout(120)
def test_a_verdict_carries_any_error_type_and_every_differing_value(spmd2):
    """An error whose class does not pickle still reaches the other rank (as a RuntimeError
    naming it) instead of leaving it waiting; a builtin or fsdpfn error keeps its type (unless
    its constructor takes more than a message); values
    that differ come back from every rank, in rank order; equal ones (a set in each process's
    hash order) are no verdict at all."""
    results = spmd2.run(verdicts, timeout=90)
    assert results[1]["local"] == ("LocalError", "odd rank's own")
    assert results[0]["local"][0] == "RuntimeError"
    assert results[0]["local"][1].startswith("(raised on rank 1) ")
    assert "LocalError: odd rank's own" in results[0]["local"][1]
    assert [r["builtin"][0] for r in results] == ["KeyError", "KeyError"]
    # a builtin type whose constructor takes more than a message: named in a RuntimeError
    assert [r["unicode"][0] for r in results] == ["RuntimeError", "UnicodeDecodeError"]
    assert "UnicodeDecodeError: 'utf-8' codec" in results[0]["unicode"][1]
    assert [r["ours"] for r in results] == [("BatchError", "(raised on rank 1) b"),
                                            ("BatchError", "b")]
    for r in results:
        assert r["values"] == [{"n": 1, "same": [1, 2]}, {"n": 2, "same": [1, 2]}]
        assert r["equal"] is None
