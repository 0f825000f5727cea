"""GPU: a micro-batch that does not fit raises MicroBatchOOMError, memory is released, and the
same state trains when the call is retried with a smaller mb_spec (no rebuild).

The device is capped (torch.cuda.set_per_process_memory_fraction) at what the model and optimizer
hold plus HEADROOM: a 48 x 2048-token batch under a 65536-token budget needs far more activation
memory than that (8 layers x 64k tokens), a 4096-token budget far less. Skipped without CUDA.

    python -m pytest -q tests/e2e/test_oom_gpu.py
"""

from __future__ import annotations

import inspect

import pytest
import torch

import fsdpfn as ff
from fsdpfn import keys as K
from fsdpfn.testing import random_batch, tiny_qwen3_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs CUDA: a real device OOM")]

GiB = 2**30
HEADROOM = 8 * GiB      # grads (0.7 GiB) + AdamW state (1.4 GiB) + 4k-token activations fit
BIG, SMALL = 65536, 4096


def _model_config() -> dict:
    return tiny_qwen3_config(vocab_size=32000, hidden_size=1024, intermediate_size=3072,
                             num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                             head_dim=128, max_position_embeddings=4096).to_dict()


@pytest.mark.timeout(600)
def test_oom_is_typed_memory_is_released_and_a_smaller_budget_retries():
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=-1))
    config = ff.EngineConfig(model_config=_model_config(), dtype="bfloat16",
                             mb_spec=ff.MicroBatchSpec(max_tokens_per_mb=BIG),
                             optimizer=ff.OptimizerConfig(lr=1e-5))
    state = ff.shard_model(config, mesh)
    batch = random_batch(48, 2048, vocab_size=32000, seed=0, min_len=1536, prompt_len=128)
    batch = ff.forward_logp(state, batch, out_key=K.OLD_LOGP,
                            mb_spec=ff.MicroBatchSpec(max_tokens_per_mb=SMALL))
    batch = batch.set(K.ADVANTAGES, torch.where(batch[K.LOSS_MASK], 1.0, 0.0))
    device = torch.cuda.current_device()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_allocated(device)
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, (baseline + HEADROOM) / total), device)
    try:
        version = state.version
        with pytest.raises(ff.MicroBatchOOMError) as info:
            ff.ppo_step(state, batch, ff.PPOConfig())
        error = info.value
        del info  # the traceback refers to frames of the failed call
        message = str(error)
        assert SMALL < error.n_tokens <= BIG and error.max_tokens_per_mb == BIG, message
        assert f"micro-batch of {error.n_tokens} tokens" in message
        assert f"max_tokens_per_mb={BIG}" in message
        assert "EngineConfig.mb_spec.max_tokens_per_mb" in message and "mb_spec=" in message
        assert "GiB held by this process" in message and "GiB in all" in message, message
        assert isinstance(error, torch.OutOfMemoryError)
        assert state.is_live and state.version == version
        assert all(p.grad is None for p in state.model.parameters())
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated(device) <= baseline + 256 * 2**20, \
            (torch.cuda.memory_allocated(device), baseline)

        small = ff.MicroBatchSpec(max_tokens_per_mb=SMALL)
        state, stats = _ppo_step(state, batch, small)
        assert float(stats["steps"]) == 1.0 and torch.isfinite(stats["loss"])
        assert state.version == version + 1
        retried_norm = float(stats["grad_norm"])
        state, stats = _ppo_step(state, batch, small)   # and keeps training
        assert float(stats["steps"]) == 1.0
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    del state
    # the interrupted pass left nothing behind: a state that never failed computes the same step
    fresh = ff.shard_model(config, mesh)
    _, stats = _ppo_step(fresh, batch, small)
    assert abs(float(stats["grad_norm"]) - retried_norm) <= 1e-2 * retried_norm, \
        (float(stats["grad_norm"]), retried_norm)


def _ppo_step(state, batch, mb_spec):
    """ppo_step with a per-call budget (through grad_step with the PPO loss where ppo_step has
    no mb_spec= yet)."""
    config = ff.PPOConfig()
    if "mb_spec" in inspect.signature(ff.ppo_step).parameters:
        return ff.ppo_step(state, batch, config, mb_spec=mb_spec)
    from fsdpfn.algos.ppo import ppo_loss_fn
    objective = ff.Objective(ppo_loss_fn(config), require=(K.LOSS_MASK, K.OLD_LOGP, K.ADVANTAGES),
                             name="ppo_step")
    return ff.grad_step(state, batch, objective, mb_spec=mb_spec)
