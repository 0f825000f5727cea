"""AdamW with Kahan-compensated bf16 master weights.

Keeping master weights and Adam moments in bf16 halves optimizer memory, but a plain bf16 AdamW
loses every update smaller than half a bf16 ulp of the weight (2^-9 relative): with small learning
rates most updates vanish and the loss plateaus. Here each parameter carries a bf16 compensation
buffer holding what rounding dropped (Kahan summation); the next step adds it back, so the
weight follows the float32 trajectory to within one bf16 ulp. Moments are kept in bf16 too; all
arithmetic is float32.

Works on plain tensors and on DTensor shards (the math is elementwise, done on local shards; the
state tensors are DTensors shaped like their parameters, so checkpoints reshard).
"""

from __future__ import annotations

import torch

__all__ = ["KahanAdamW"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t  # noqa: SLF001


class KahanAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) for bf16 parameters with Kahan-compensated updates."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    for name in ("exp_avg", "exp_avg_sq", "compensation"):
                        state[name] = torch.zeros_like(p)
                state["step"] += 1
                step = float(state["step"])
                w = _local(p)
                g = _local(p.grad).float()
                m, v, comp = (_local(state[k]) for k in ("exp_avg", "exp_avg_sq", "compensation"))
                m32 = m.float().mul_(beta1).add_(g, alpha=1 - beta1)
                v32 = v.float().mul_(beta2).addcmul_(g, g, value=1 - beta2)
                m.copy_(m32)
                v.copy_(v32)
                denom = (v32 / (1 - beta2 ** step)).sqrt_().add_(group["eps"])
                w32 = w.float()
                delta = (m32 / (1 - beta1 ** step)).div_(denom).mul_(-group["lr"])
                if group["weight_decay"]:
                    delta.add_(w32, alpha=-group["lr"] * group["weight_decay"])
                # Kahan: add the step plus what the last rounding dropped, keep what this one drops
                y = delta.add_(comp.float())
                new = (w32 + y).to(w.dtype)
                comp.copy_(y.sub_(new.float() - w32))
                w.copy_(new)
        return loss
