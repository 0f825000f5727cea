"""AdamW with Kahan-compensated bf16 master weights, as multi-tensor work.

Keeping master weights and Adam moments in bf16 halves optimizer memory, but a plain bf16 AdamW
loses every update smaller than half a bf16 ulp of the weight (2^-9 relative): with small learning
rates most updates vanish and the loss plateaus. Here each parameter carries a bf16 compensation
buffer holding what rounding dropped (Kahan summation); the next step adds it back, so the
weight follows the float32 trajectory to within one bf16 ulp. Moments are kept in bf16 too; all
arithmetic is float32.

The step is ``torch._foreach_*`` work over lists of tensors: the step counts are 0-dim tensors on
the parameters' device (the bias corrections are computed there), so a step never synchronises
with the host. Float32 temporaries are bounded: the tensors are cut into flat slices of at most
``chunk_numel`` elements and processed chunk by chunk.

Works on plain tensors and on DTensor shards (the math is elementwise, done on local shards; the
state tensors are DTensors shaped like their parameters, so checkpoints reshard).
"""

from __future__ import annotations

from typing import Iterator, Sequence

import torch

__all__ = ["KahanAdamW", "kahan_adamw_", "CHUNK_NUMEL"]

CHUNK_NUMEL = 1 << 25  # elements per chunk: ~10 float32 temporaries of 128 MiB each

Tensors = Sequence[torch.Tensor]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t  # noqa: SLF001


def _chunks(lists: Sequence[Tensors], steps: Tensors, limit: int
            ) -> Iterator[tuple[list[list[torch.Tensor]], list[torch.Tensor]]]:
    """The same elements of every list, as chunks of flat slices of at most ``limit`` elements
    (a contiguous tensor larger than ``limit`` is cut; a non-contiguous one stays whole), with
    the step tensor of each slice's parameter."""
    chunk: list[list[torch.Tensor]] = [[] for _ in lists]
    chunk_steps: list[torch.Tensor] = []
    size = 0
    for i, step in enumerate(steps):
        whole = [lst[i] for lst in lists]
        flat = all(t.is_contiguous() for t in whole)
        views = [t.view(-1) for t in whole] if flat else whole
        n = whole[0].numel()
        for start in range(0, max(n, 1), limit if flat else max(n, 1)):
            pieces = [v[start:start + limit] for v in views] if flat else views
            numel = pieces[0].numel()
            if size and size + numel > limit:
                yield chunk, chunk_steps
                chunk, chunk_steps, size = [[] for _ in lists], [], 0
            for out, piece in zip(chunk, pieces):
                out.append(piece)
            chunk_steps.append(step)
            size += numel
    if chunk_steps:
        yield chunk, chunk_steps


def _as_float32(tensors: Tensors) -> list[torch.Tensor]:
    """Float32 copies (the tensors themselves when already float32: callers only read them or
    write back what they computed)."""
    if all(t.dtype == torch.float32 for t in tensors):
        return list(tensors)
    out = [torch.empty_like(t, dtype=torch.float32) for t in tensors]
    torch._foreach_copy_(out, tensors)
    return out


def _one_minus_pow(base: float, steps: Tensors) -> list[torch.Tensor]:
    out = torch._foreach_pow(base, list(steps))  # base ** step, on the steps' device
    torch._foreach_neg_(out)
    torch._foreach_add_(out, 1.0)
    return list(out)


def _kahan_chunk(params, grads, exp_avgs, exp_avg_sqs, comps, steps, *, lr, beta1, beta2, eps,
                 weight_decay) -> None:
    g = _as_float32(grads)
    m = _as_float32(exp_avgs)
    torch._foreach_lerp_(m, g, 1.0 - beta1)
    v = _as_float32(exp_avg_sqs)
    torch._foreach_mul_(v, beta2)
    torch._foreach_addcmul_(v, g, g, 1.0 - beta2)
    torch._foreach_copy_(exp_avgs, m)
    torch._foreach_copy_(exp_avg_sqs, v)
    bc1 = _one_minus_pow(beta1, steps)  # 1 - beta1^t
    bc2 = _one_minus_pow(beta2, steps)
    torch._foreach_sqrt_(bc2)  # sqrt(1 - beta2^t)
    denom = list(torch._foreach_sqrt(v))
    torch._foreach_div_(denom, bc2)
    torch._foreach_add_(denom, eps)
    delta = list(torch._foreach_div(m, denom))  # the Adam update: -lr * m_hat / (sqrt(v_hat) + eps)
    torch._foreach_div_(delta, bc1)
    torch._foreach_mul_(delta, -lr)
    w = _as_float32(params)
    if weight_decay:
        torch._foreach_add_(delta, w, alpha=-lr * weight_decay)
    # Kahan: add the step plus what the last rounding dropped, keep what this one drops
    torch._foreach_add_(delta, _as_float32(comps))  # y
    new = list(torch._foreach_add(w, delta))  # w + y, float32
    rounded = [torch.empty_like(p) for p in params]
    torch._foreach_copy_(rounded, new)  # rounded to the parameters' dtype
    torch._foreach_copy_(new, rounded)
    torch._foreach_sub_(new, w)  # what was actually added
    torch._foreach_sub_(delta, new)  # what rounding dropped
    torch._foreach_copy_(comps, delta)
    torch._foreach_copy_(params, rounded)


@torch.no_grad()
def kahan_adamw_(params: Tensors, grads: Tensors, exp_avgs: Tensors, exp_avg_sqs: Tensors,
                 compensations: Tensors, steps: Tensors, *, lr: float, beta1: float, beta2: float,
                 eps: float, weight_decay: float = 0.0, chunk_numel: int = CHUNK_NUMEL) -> None:
    """One Kahan-compensated AdamW step, in place, on lists of plain (local) tensors.

    ``steps`` are 0-dim float32 tensors on the parameters' device, one per parameter, advanced
    by one here. Every list holds one tensor per parameter, shaped like it; moments and
    compensation may be in any float dtype (the math is float32). No host synchronisation."""
    if not params:
        return
    torch._foreach_add_(list(steps), 1.0)
    lists = (params, grads, exp_avgs, exp_avg_sqs, compensations)
    for (p, g, m, v, c), s in _chunks(lists, steps, chunk_numel):
        _kahan_chunk(p, g, m, v, c, s, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                     weight_decay=weight_decay)


class KahanAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) for bf16 parameters with Kahan-compensated updates."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, *, chunk_numel: int = CHUNK_NUMEL):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.chunk_numel = chunk_numel

    def _state_of(self, param: torch.Tensor) -> dict:
        state = self.state[param]
        device = _local(param).device
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=device)
            for name in ("exp_avg", "exp_avg_sq", "compensation"):
                state[name] = torch.zeros_like(param)
        elif state["step"].device != device:  # loaded from a checkpoint: the step on the host
            state["step"] = state["step"].to(device=device, dtype=torch.float32)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            states = [self._state_of(p) for p in params]
            beta1, beta2 = group["betas"]
            kahan_adamw_([_local(p) for p in params], [_local(p.grad) for p in params],
                         *([_local(s[k]) for s in states]
                           for k in ("exp_avg", "exp_avg_sq", "compensation")),
                         [s["step"] for s in states], lr=group["lr"], beta1=beta1, beta2=beta2,
                         eps=group["eps"], weight_decay=group["weight_decay"],
                         chunk_numel=self.chunk_numel)
        return loss
