"""Every argument of the public functions, given a value of the wrong kind (None, a number, a
list, a mapping, bytes, a tensor, an object), is refused with one of fsdpfn's errors naming the
argument: never an AttributeError, TypeError or ValueError from deep inside, and never
accepted. The state stays usable after each refusal."""

import math

import pytest
import torch

import fsdpfn as ff
from fsdpfn import keys as K
from fsdpfn.testing.batches import random_batch, with_ppo_keys
from fsdpfn.testing.models import tiny_qwen2_config

FSDPFN_ERRORS = (ff.ConfigError, ff.BatchError, ff.CheckpointError, ff.WeightSyncError,
                 ff.StaleStateError)
HOSTILE = {"None": None, "-1": -1, "1e20": 10**20, "1.5": 1.5, "nan": math.nan, "True": True,
           "[1]": [1], "{a:1}": {"a": 1}, "object": object(), "bytes": b"x",
           "tensor": torch.zeros(2)}
URL = "http://127.0.0.1:9"


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    mesh = ff.build_mesh(ff.ParallelStrategy(), device_type="cpu")
    config = ff.EngineConfig(model_config=tiny_qwen2_config().to_dict(), dtype="float32")
    return {"mesh": mesh, "config": config, "state": ff.shard_model(config, mesh),
            "tmp": tmp_path_factory.mktemp("args")}


def _batch():
    return with_ppo_keys(random_batch(4, 12, seed=0))


def _nll(outputs, mb, ctx):
    return -(outputs[K.LOGP] * mb[K.LOSS_MASK]).sum(), {}


def _stream(**kw):
    args = {"urls": URL, "prompt_at": lambda i: [1, 2], "group_size": 1, "groups_per_step": 1}
    args.update(kw)
    ff.RolloutStream(args.pop("urls"), args.pop("prompt_at"), **args).close()


ANSWER = [{"output_ids": [3], "output_logprobs": [-0.5]}]
# name in the message, the call, values of HOSTILE it takes (or refuses by another rule: 1e20
# optimizer steps are more than the batch's rows)
CALLS = {
    "build_mesh.strategy": ("strategy", lambda e, v: ff.build_mesh(v, device_type="cpu"), ()),
    "build_mesh.device_type": ("device_type", lambda e, v: ff.build_mesh(
        ff.ParallelStrategy(), device_type=v), ("None",)),
    "shard_model.config": ("config", lambda e, v: ff.shard_model(v, e["mesh"]), ()),
    "shard_model.mesh": ("mesh", lambda e, v: ff.shard_model(e["config"], v), ()),
    "forward_logp.state": ("state", lambda e, v: ff.forward_logp(v, _batch()), ()),
    "forward_logp.batch": ("batch", lambda e, v: ff.forward_logp(e["state"], v), ()),
    "forward_logp.out_key": ("out_key", lambda e, v: ff.forward_logp(e["state"], _batch(),
                                                                     out_key=v), ()),
    "forward_logp.with_entropy": ("with_entropy", lambda e, v: ff.forward_logp(
        e["state"], _batch(), with_entropy=v), ("True",)),
    "forward_logp.temperature": ("temperature", lambda e, v: ff.forward_logp(
        e["state"], _batch(), temperature=v), ("None", "1.5", "1e20")),
    "compute_advantages.batch": ("batch", lambda e, v: ff.compute_advantages(
        v, ff.AdvantageConfig()), ()),
    "compute_advantages.config": ("config", lambda e, v: ff.compute_advantages(_batch(), v), ()),
    "compute_advantages.mesh": ("mesh", lambda e, v: ff.compute_advantages(
        _batch(), ff.AdvantageConfig(), mesh=v), ("None",)),
    "grad_step.loss_fn": ("loss_fn", lambda e, v: ff.grad_step(e["state"], _batch(), v), ()),
    "grad_step.optimizer_steps": ("optimizer_steps", lambda e, v: ff.grad_step(
        e["state"], _batch(), ff.Objective(_nll), optimizer_steps=v), ("1e20",)),
    "evaluate.loss_fn": ("loss_fn", lambda e, v: ff.evaluate(e["state"], _batch(), v), ()),
    "ppo_step.config": ("config", lambda e, v: ff.ppo_step(e["state"], _batch(), v), ()),
    "sft_step.config": ("config", lambda e, v: ff.sft_step(e["state"], _batch(), v), ()),
    "save_checkpoint.path": ("path", lambda e, v: ff.save_checkpoint(e["state"], v), ()),
    "load_checkpoint.path": ("path", lambda e, v: ff.load_checkpoint(e["state"], v), ()),
    "export_hf.path": ("path", lambda e, v: ff.export_hf(e["state"], v), ()),
    "latest_checkpoint.root": ("path", lambda e, v: ff.latest_checkpoint(v), ()),
    "latest_intact_checkpoint.fallback": ("fallback", lambda e, v: ff.latest_intact_checkpoint(
        e["tmp"], fallback=v), ("True",)),
    "check_checkpoint.path": ("path", lambda e, v: ff.check_checkpoint(v), ()),
    "last_timings.state": ("state", lambda e, v: ff.last_timings(v), ()),
    "profile.out_dir": ("out_dir", lambda e, v: ff.profile(v).__enter__(), ()),
    "profile.steps": ("steps", lambda e, v: ff.profile(e["tmp"] / "p", steps=v).__exit__(
        None, None, None), ("None", "[1]")),
    "push_weights.target": ("target", lambda e, v: ff.push_weights(e["state"], v), ()),
    "DiskTarget.root": ("root", lambda e, v: ff.DiskTarget(v), ()),
    "RolloutTarget.url": ("url", lambda e, v: ff.RolloutTarget(v), ()),
    "AdapterTarget.urls": ("urls", lambda e, v: ff.AdapterTarget(v, root=e["tmp"]), ()),
    "AdapterTarget.root": ("root", lambda e, v: ff.AdapterTarget([URL], root=v), ()),
    "shard_batch.batch": ("batch", lambda e, v: ff.shard_batch(v, e["mesh"]), ()),
    "shard_batch.mesh": ("mesh", lambda e, v: ff.shard_batch(_batch(), v), ()),
    "shard_batch.group_size": ("group_size", lambda e, v: ff.shard_batch(
        _batch(), e["mesh"], group_size=v), ("None",)),
    "gather_batch.batch": ("batch", lambda e, v: ff.gather_batch(v, e["mesh"]), ()),
    "gather_batch.mesh": ("mesh", lambda e, v: ff.gather_batch(_batch(), v), ()),
    "rollout_batch.prompts": ("prompts", lambda e, v: ff.rollout_batch(v, ANSWER, 1, [1.0]), ()),
    "rollout_batch.outputs": ("outputs", lambda e, v: ff.rollout_batch([[1, 2]], v, 1, [1.0]),
                              ()),
    "rollout_batch.group_size": ("group_size", lambda e, v: ff.rollout_batch(
        [[1, 2]], ANSWER, v, [1.0]), ()),
    "rollout_batch.rewards": ("rewards", lambda e, v: ff.rollout_batch([[1, 2]], ANSWER, 1, v),
                              ("[1]",)),
    "rollout_batch.output_ids": ("output_ids", lambda e, v: ff.rollout_batch(
        [[1, 2]], [{"output_ids": v, "output_logprobs": [-0.5]}], 1, [1.0]), ("[1]",)),
    "rollout_batch.output_logprobs": ("output_logprobs", lambda e, v: ff.rollout_batch(
        [[1, 2]], [{"output_ids": [3], "output_logprobs": v}], 1, [1.0]), ("[1]",)),
    "RolloutStream.urls": ("urls", lambda e, v: _stream(urls=v), ()),
    "RolloutStream.prompt_at": ("prompt_at", lambda e, v: _stream(prompt_at=v), ()),
    "RolloutStream.score": ("score", lambda e, v: _stream(score=v), ("None",)),
    "RolloutStream.sampling": ("sampling", lambda e, v: _stream(sampling=v), ("None",)),
    "RolloutStream.group_size": ("group_size", lambda e, v: _stream(group_size=v), ("1e20",)),
    "RolloutStream.seed": ("seed", lambda e, v: _stream(seed=v), ("None",)),
    "RolloutStream.max_staleness": ("max_staleness", lambda e, v: _stream(max_staleness=v),
                                    ("1e20",)),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("call", sorted(CALLS))
def test_a_value_of_the_wrong_kind_is_refused_naming_the_argument(env, call):
    name, fn, valid = CALLS[call]
    for shown, value in HOSTILE.items():
        if shown in valid:
            continue
        try:
            fn(env, value)
        except FSDPFN_ERRORS as exc:
            assert name in str(exc), (call, shown, str(exc))
        except Exception as exc:  # noqa: BLE001 - the finding the test is for
            pytest.fail(f"{call} = {shown}: {type(exc).__name__}: {exc}")
        else:
            pytest.fail(f"{call} = {shown}: accepted")
    out = ff.forward_logp(env["state"], _batch())  # every refusal left the state usable
    assert torch.isfinite(out[K.LOGP]).all()


def test_a_rollout_batch_of_token_ids_in_other_integer_types_is_the_same_batch():
    import numpy as np

    want = ff.rollout_batch([[1, 2]], ANSWER, 1, [1.0])
    for prompt, ids, reward in (((1, 2), (3,), (True,)), (torch.tensor([1, 2]), np.array([3]),
                                                          np.array([1.0]))):
        got = ff.rollout_batch([prompt], [{"output_ids": ids, "output_logprobs": [-0.5]}], 1,
                               reward)
        for key in want.keys():
            assert torch.equal(got[key], want[key]), key
