"""GPU: LoRA adapters inside compiled decoder blocks (``EngineConfig.compile`` with ``lora``)
train as the same adapters do eager, on one CUDA device in bfloat16.

* every decoder block runs its compiled forward, with peft's adapter layers inside it;
* over three sft_steps (gradient clipping at 0.5) from the same weights, the compiled run's
  losses are the eager run's within bfloat16's rounding, and its adapters moved as eager's did
  (the two updates point the same way by the same amount), the frozen base untouched in both;
* forward_logp after the steps (adapters on) agrees with eager's within bfloat16's rounding.

On CPU the same pair was checked by hand (float32 within 1e-6; bfloat16: losses within 2e-5,
the updates' cosine about 0.99, log-probs within 0.022); as a CPU test it cost a cold compile of
95 s in CI, so it runs here.

    python -m pytest -q tests/e2e/test_lora_gpu.py
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

import fsdpfn as ff
from fsdpfn import keys as K
from fsdpfn.engine import lora
from fsdpfn.testing import random_batch, tiny_qwen2_config
from fsdpfn.testing.models import compiled_blocks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs CUDA")]

V = 8192
OPT = ff.OptimizerConfig(lr=2e-3, max_grad_norm=0.5)
LORA = ff.LoRAConfig(rank=16, alpha=32.0)


def _state(compile: bool, device: str = "cuda"):
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=-1), device_type=device)
    cfg = tiny_qwen2_config(vocab_size=V, hidden_size=512, intermediate_size=1536,
                            num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=2)
    config = ff.EngineConfig(model_config=cfg.to_dict(), dtype="bfloat16", optimizer=OPT,
                             lora=LORA, seed=3, compile=compile)
    return ff.shard_model(config, mesh)


def _batch(seed: int) -> TensorDict:
    """8 rows of 128 to 256 tokens, the first 16 a prompt."""
    return random_batch(8, 256, vocab_size=V, seed=seed, min_len=128, prompt_len=16)


def _weights(state) -> tuple[dict, dict]:
    """(adapters, base) as float64 on the host, by name."""
    adapters, base = {}, {}
    for name, param in state.model.named_parameters():
        local = param.to_local() if hasattr(param, "to_local") else param
        (adapters if lora.is_adapter(name) else base)[name] = local.detach().double().cpu()
    return adapters, base


def _run(compile: bool, device: str = "cuda"):
    state = _state(compile, device)
    compiled = compiled_blocks(state)
    start = _weights(state)
    losses = []
    for i in range(3):
        state, stats = ff.sft_step(state, _batch(i), ff.SFTConfig())
        losses.append(float(stats["loss"]))
    logp = ff.forward_logp(state, _batch(99))[K.LOGP].double().cpu()
    return compiled, start, _weights(state), losses, logp


@pytest.mark.timeout(600)
def test_compiled_blocks_with_lora_train_as_eager_lora_on_cuda():
    n_eager, start, (ad_e, base_e), loss_e, logp_e = _run(compile=False)
    n_comp, start_c, (ad_c, base_c), loss_c, logp_c = _run(compile=True)
    assert n_eager == 0 and n_comp == 6, (n_eager, n_comp)  # every block compiled, none eager
    # the same seed: the same starting weights (B = 0, so the first loss is the base model's)
    for name, value in start[0].items():
        assert torch.equal(value, start_c[0][name]), name
    torch.testing.assert_close(torch.tensor(loss_c), torch.tensor(loss_e), rtol=5e-3, atol=0)
    # the frozen base did not move in either run
    for name, value in start[1].items():
        assert torch.equal(base_e[name], value) and torch.equal(base_c[name], value), name
    # the adapters moved, and the two runs moved them alike: Adam's first steps are about
    # lr * sign(gradient), so elements of near-zero gradient may step either way under
    # bfloat16's rounding; the updates as wholes point the same way by the same amount
    step_e = torch.cat([(ad_e[n] - start[0][n]).flatten() for n in sorted(ad_e)])
    step_c = torch.cat([(ad_c[n] - start[0][n]).flatten() for n in sorted(ad_e)])
    cosine = float(step_e @ step_c / (step_e.norm() * step_c.norm()))
    ratio = float(step_c.norm() / step_e.norm())
    mask = _batch(99)[K.ATTENTION_MASK]
    diff = (logp_c - logp_e)[mask].abs()
    print(f"\ncompiled LoRA against eager: losses {loss_c} / {loss_e}, updates' cosine "
          f"{cosine:.4f}, norm ratio {ratio:.4f}, |Δlogp| mean {float(diff.mean()):.4f} max "
          f"{float(diff.max()):.4f}")
    assert step_e.norm() > 0 and cosine > 0.97 and abs(ratio - 1) < 0.05, (cosine, ratio)
    assert float(diff.mean()) < 0.02 and float(diff.max()) < 0.25, (diff.mean(), diff.max())
