"""KahanAdamW: bf16 weights follow the float32 AdamW trajectory where plain bf16 AdamW stalls."""

from __future__ import annotations

import torch

from fsdpfn.optim import KahanAdamW


def _run(opt_cls, dtype, lr=1e-4, steps=300, weight_decay=0.01):
    torch.manual_seed(0)
    target = torch.randn(64, 32)
    x = torch.randn(256, 32)
    w = torch.nn.Parameter((torch.randn(64, 32) + 4.0).to(dtype))  # |w| ~ 4: bf16 ulp ~ 0.03
    opt = opt_cls([w], lr=lr, weight_decay=weight_decay)
    for _ in range(steps):
        loss = ((x @ w.float().t() - x @ target.t()) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return w.detach().float()


def test_kahan_bf16_tracks_float32_where_plain_bf16_stalls():
    start = (torch.manual_seed(0), torch.randn(64, 32), torch.randn(256, 32),
             torch.randn(64, 32) + 4.0)[3]
    ref = _run(torch.optim.AdamW, torch.float32)
    kahan = _run(KahanAdamW, torch.bfloat16)
    plain = _run(torch.optim.AdamW, torch.bfloat16)
    moved = (ref - start).abs().mean()
    assert moved > 0.02  # 300 steps of ~1e-4: the float32 weights moved by ~0.03
    # plain bf16: updates of 1e-4 are below half an ulp at |w| ~ 4 and vanish
    assert (plain - start.to(torch.bfloat16).float()).abs().mean() < 0.1 * moved
    # Kahan: within one bf16 ulp (2^-7 relative: 8 significant bits) of the float32 weights
    assert torch.all((kahan - ref).abs() <= 2 ** -7 * ref.abs() * 1.01)
    # on average at the level of rounding the stored value, well under one ulp (plain bf16 is
    # off by the whole movement, ~one ulp here)
    assert (kahan - ref).abs().mean() < 0.5 * (2 ** -7 * ref.abs()).mean()
    assert (plain - ref).abs().mean() > 0.8 * moved


def test_kahan_matches_adamw_in_float32():
    # with float32 parameters the compensation is ~0 and the update is AdamW's
    ref = _run(torch.optim.AdamW, torch.float32, lr=1e-2, steps=50)
    ours = _run(KahanAdamW, torch.float32, lr=1e-2, steps=50)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
