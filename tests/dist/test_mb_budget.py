"""Micro-batch budgets per call, and out-of-memory errors that leave the state usable.

A device out-of-memory error is injected on CPU (torch.OutOfMemoryError raised by a forward
hook or by the loss for micro-batches over a token threshold); the typed MicroBatchOOMError must
name the micro-batch's tokens, the budget and the option, and a retry with a smaller mb_spec on
the same state must train exactly like a reference state that never failed. The real CUDA case
is tests/e2e/test_oom_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

import fsdpfn as ff
from fsdpfn import keys as K
from fsdpfn.algos.sft import sft_loss_fn
from fsdpfn.testing import random_batch, tiny_qwen2_config

LIMIT = 40  # tokens: a micro-batch above this "runs out of memory"


def _state(**kw):
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=-1), device_type="cpu")
    cfg = ff.EngineConfig(model_config=tiny_qwen2_config().to_dict(), dtype="float32", seed=3,
                          optimizer=ff.OptimizerConfig(lr=1e-2), **kw)
    return ff.shard_model(cfg, mesh)


def _params(state):
    return {n: p.detach().full_tensor().clone() if hasattr(p, "full_tensor") else p.detach().clone()
            for n, p in state.model.named_parameters()}


def _oom_over_limit(loss_fn):
    def wrapped(outputs, mb, ctx):
        if int(mb[K.ATTENTION_MASK].sum()) > LIMIT:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return loss_fn(outputs, mb, ctx)
    return wrapped


def oom_in_step_then_retry():
    batch = random_batch(8, 12, seed=4)
    loss = sft_loss_fn(ff.SFTConfig())
    state = _state(mb_spec=ff.MicroBatchSpec(max_tokens_per_mb=None))   # one micro-batch
    version, before = state.version, _params(state)
    try:
        ff.grad_step(state, batch, _oom_over_limit(loss))
        error = None
    except ff.MicroBatchOOMError as exc:
        error = exc
    grads_left = [n for n, p in state.model.named_parameters() if p.grad is not None]
    unchanged = all(torch.equal(before[n], p) for n, p in _params(state).items())
    small = ff.MicroBatchSpec(max_tokens_per_mb=LIMIT)
    retried, stats = ff.grad_step(state, batch, _oom_over_limit(loss), mb_spec=small)
    # never failed, same micro-batch plan: the same float operations in the same order
    reference, ref_stats = ff.grad_step(_state(), batch, loss, mb_spec=small)
    diff = max(float((a - b).abs().max()) for a, b in zip(_params(retried).values(),
                                                          _params(reference).values()))
    return {"error": str(error), "type": type(error).__name__,
            "is_torch_oom": isinstance(error, torch.OutOfMemoryError),
            "n_tokens": getattr(error, "n_tokens", None),
            "tokens": int(batch[K.ATTENTION_MASK].sum()),
            "budget": getattr(error, "max_tokens_per_mb", "?"), "version": (version, state.version),
            "grads_left": grads_left, "unchanged": unchanged, "diff": diff,
            "loss": (float(stats["loss"]), float(ref_stats["loss"])),
            "config_budget": retried.config.mb_spec.max_tokens_per_mb}


@pytest.mark.timeout(200)
def test_oom_in_a_step_is_typed_and_a_smaller_budget_retries_on_the_same_state(spmd1):
    r = spmd1.run(oom_in_step_then_retry, timeout=150)[0]
    assert r["type"] == "MicroBatchOOMError" and r["is_torch_oom"], r
    assert r["n_tokens"] == r["tokens"] and r["budget"] is None, r
    for part in (f"micro-batch of {r['tokens']} tokens", "max_tokens_per_mb=None",
                 "EngineConfig.mb_spec.max_tokens_per_mb", "mb_spec=MicroBatchSpec("):
        assert part in r["error"], (part, r["error"])
    assert r["version"][0] == r["version"][1] and r["unchanged"] and not r["grads_left"], r
    # The retry trains like a state that never failed. The reference runs the same micro-batch
    # plan, so both steps are the same float operations in the same order: the parameters agree
    # bitwise. (Against a one-micro-batch reference no useful bound exists: Adam's first step is
    # lr * g / (|g| + eps), whose sensitivity to g is up to lr / eps = 1e6, so a summation-order
    # difference of 1e-11 in a near-zero gradient moves a parameter by 1e-5.)
    assert r["diff"] == 0.0, r
    assert r["loss"][0] == r["loss"][1], r
    assert r["config_budget"] is None            # the override was for that call only


def oom_in_forward_then_retry():
    state = _state(mb_spec=ff.MicroBatchSpec(max_tokens_per_mb=4096))
    batch = random_batch(8, 12, seed=5)

    def hook(module, args):
        if args[0].numel() > LIMIT:  # PackedModel(input_ids[N], ...)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")

    handle = state.model.register_forward_pre_hook(hook)
    try:
        try:
            ff.forward_logp(state, batch, out_key=K.OLD_LOGP)
            error = None
        except ff.MicroBatchOOMError as exc:
            error = exc
        small = ff.MicroBatchSpec(max_tokens_per_mb=LIMIT)
        retried = ff.forward_logp(state, batch, out_key=K.OLD_LOGP, mb_spec=small)[K.OLD_LOGP]
        sft_ok = ff.sft_step(state, batch, ff.SFTConfig(), mb_spec=small)[1]["steps"]
    finally:
        handle.remove()
    whole = ff.forward_logp(_state(), batch, out_key=K.OLD_LOGP)[K.OLD_LOGP]
    return str(error), float((retried - whole).abs().max()), float(sft_ok)


@pytest.mark.timeout(200)
def test_oom_in_forward_logp_is_typed_and_mb_spec_overrides_one_call(spmd1):
    message, diff, steps = spmd1.run(oom_in_forward_then_retry, timeout=150)[0]
    assert message.startswith("forward_logp: out of device memory on a micro-batch of "), message
    # the suggestion halves what ran out of memory: the micro-batch (71 tokens) when it was
    # smaller than the budget (4096), so the retry really plans smaller micro-batches
    n_tokens = int(message.split("micro-batch of ")[1].split()[0])
    assert n_tokens < 4096 and "max_tokens_per_mb=4096" in message, message
    assert f"mb_spec=MicroBatchSpec(max_tokens_per_mb={n_tokens // 2})" in message, message
    assert diff <= 1e-6 and steps == 1.0


def out_keys_and_specs_refused():
    state = _state()
    critic = _state(is_critic=True)
    batch = random_batch(4, 8, seed=1)
    snap = {k: v.clone() for k, v in batch.items()}
    found = []
    calls = [lambda: ff.forward_logp(state, batch, out_key=K.INPUT_IDS),
             lambda: ff.forward_logp(state, batch, out_key=K.LOSS_MASK),
             lambda: ff.forward_logp(state, batch, out_key=K.ENTROPY, with_entropy=True),
             lambda: ff.compute_values(critic, batch, out_key=K.ATTENTION_MASK),
             lambda: ff.forward_logp(state, batch, mb_spec={"max_tokens_per_mb": 8}),
             lambda: ff.sft_step(state, batch, mb_spec=8)]
    for call in calls:
        try:
            call()
            found.append(None)
        except ff.ConfigError as exc:
            found.append(str(exc))
    same = all(torch.equal(batch[k], v) for k, v in snap.items())
    ok = ff.forward_logp(state, batch, out_key=K.ENTROPY)  # without with_entropy it is a name
    return found, same, K.ENTROPY in ok.keys(), state.is_live


@pytest.mark.timeout(200)
def test_out_key_naming_an_input_and_bad_mb_spec_are_refused(spmd2):
    for found, same, entropy_ok, live in spmd2.run(out_keys_and_specs_refused, timeout=150):
        assert found[0] and "out_key: must not name a key the engine reads" in found[0]
        assert "'input_ids'" in found[0] and "'loss_mask'" in found[1]
        assert "'entropy'" in found[2] and "'attention_mask'" in found[3]
        assert found[4] and found[4].startswith("mb_spec: must be a MicroBatchSpec")
        assert found[5] and found[5].startswith("mb_spec: must be a MicroBatchSpec")
        assert same and entropy_ok and live
