"""GPU: the optional Liger head (logprobs_impl="liger") against a float64 reference, and against
chunked_logprobs, in values and gradients; then forward_logp and ppo_step through it.

Skipped without CUDA or liger-kernel. Liger rounds each chunk's logits to bf16 before its float32
softmax (chunked_logprobs keeps float32 logits), so its error is that rounding: bounded here by
LIGER_TOL, against CHUNKED_TOL for the chunked head.

    python -m pytest -q tests/e2e/test_liger_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from fsdpfn.ops import chunked_logprobs
from fsdpfn.ops.logprobs import liger_available, liger_logprobs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or not liger_available("cuda"),
    reason="needs CUDA and liger-kernel")]

CHUNKED_TOL = 2e-3   # bf16 inputs, float32 products and softmax
LIGER_TOL = 0.1      # logits rounded to bf16 (|logit| ~ 5: half an ulp is ~0.016, summed)
GRAD_REL_TOL = 3e-2  # relative L2 error of the gradients against float64


def _reference(hidden, weight, targets, temperature, g):
    h = hidden.double().requires_grad_(True)
    w = weight.double().requires_grad_(True)
    logp = torch.log_softmax(h @ w.T / temperature, -1).gather(-1, targets[:, None])[:, 0]
    (logp * g.double()).sum().backward()
    return logp.detach(), h.grad, w.grad


def _rel(a, b):
    return float((a.double() - b).norm() / b.norm())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_liger_head_matches_float64_and_chunked(temperature):
    torch.manual_seed(0)
    n, v, h = 3000, 32003, 512
    hidden = (torch.randn(n, h, device="cuda") * 0.8).bfloat16()
    weight = (torch.randn(v, h, device="cuda") * 0.08).bfloat16()
    targets = torch.randint(0, v, (n,), device="cuda")
    g = torch.randn(n, device="cuda")
    ref, ref_dh, ref_dw = _reference(hidden, weight, targets, temperature, g)
    out = {}
    for name in ("chunked", "liger"):
        x = hidden.clone().requires_grad_(True)
        w = weight.clone().requires_grad_(True)
        if name == "chunked":
            logp, _ = chunked_logprobs(x, w, targets, temperature=temperature, chunk_size=512)
        else:
            logp = liger_logprobs(x, w, targets, temperature=temperature)
        assert logp.dtype == torch.float32 and logp.shape == (n,)
        (logp * g).sum().backward()
        out[name] = (logp.detach(), x.grad, w.grad)
    assert float((out["chunked"][0] - ref).abs().max()) < CHUNKED_TOL
    assert float((out["liger"][0] - ref).abs().max()) < LIGER_TOL
    assert float((out["liger"][0] - out["chunked"][0]).abs().mean()) < LIGER_TOL / 10
    for name in ("chunked", "liger"):
        assert _rel(out[name][1], ref_dh) < GRAD_REL_TOL, name
        assert _rel(out[name][2], ref_dw) < GRAD_REL_TOL, name


@pytest.mark.timeout(300)
def test_forward_logp_and_ppo_step_through_the_liger_head():
    from tensordict import TensorDict

    import fsdpfn as ff
    from fsdpfn.testing import tiny_qwen2_config

    torch.cuda.set_device(0)
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=1), device_type="cuda")
    cfg = tiny_qwen2_config(vocab_size=4096, hidden_size=256, intermediate_size=512,
                            num_attention_heads=4, num_key_value_heads=2).to_dict()
    states = {impl: ff.shard_model(ff.EngineConfig(model_config=cfg, logprobs_impl=impl,
                                                   optimizer=ff.OptimizerConfig(lr=1e-4)), mesh)
              for impl in ("chunked", "liger")}
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 4096, (6, 40), generator=g)
    attn = torch.ones(6, 40, dtype=torch.bool)
    attn[3:, 30:] = False
    loss_mask = attn.clone()
    loss_mask[:, :5] = False
    batch = TensorDict({"input_ids": ids, "attention_mask": attn, "loss_mask": loss_mask,
                        "advantages": torch.randn(6, 40, generator=g)}, batch_size=[6])
    logps = {impl: ff.forward_logp(s, batch)["logp"] for impl, s in states.items()}
    assert float((logps["liger"] - logps["chunked"]).abs().max()) < LIGER_TOL
    batch = ff.forward_logp(states["liger"], batch, out_key="old_logp")
    state, stats = ff.ppo_step(states["liger"], batch, ff.PPOConfig())
    assert torch.isfinite(torch.tensor(float(stats["loss"]))) and state.step == 1
