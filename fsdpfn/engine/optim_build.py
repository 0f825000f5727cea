"""The optimizer and learning-rate schedule of an EngineConfig (shard_model builds them).

AdamW with weight decay on matrices only; Kahan-compensated AdamW for bf16 master weights
(fsdpfn.engine.optim); the per-layer host-memory step (fsdpfn.engine.optim_offload); warm-up then a constant,
linear or cosine schedule down to ``min_lr_ratio``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from fsdpfn.config import OptimizerConfig
from fsdpfn.engine.optim import KahanAdamW
from fsdpfn.engine.optim_offload import PerLayerAdamW, fsdp_units

__all__ = ["build_optimizer", "build_scheduler", "lr_factor"]


def build_optimizer(model: nn.Module, opt: OptimizerConfig, *,
                    master_dtype: str = "float32", per_layer: bool = False,
                    prefetch_layers: int = 1, device=None) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only (norm weights and biases are skipped). With bf16
    master weights, Kahan-compensated AdamW (fsdpfn.engine.optim) so small updates are not lost.
    ``per_layer``: the same math with the state in host memory, stepped on ``device`` one FSDP
    unit at a time (fsdpfn.engine.optim_offload.PerLayerAdamW)."""
    decay, no_decay = [], []
    for param in model.parameters():
        if param.requires_grad:
            (decay if param.ndim >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": opt.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    if per_layer:
        return PerLayerAdamW(groups, units=fsdp_units(model), device=device, lr=opt.lr,
                             betas=opt.betas, eps=opt.eps, prefetch_layers=prefetch_layers,
                             kahan=master_dtype == "bfloat16")
    if master_dtype == "bfloat16":
        return KahanAdamW(groups, lr=opt.lr, betas=opt.betas, eps=opt.eps)
    # On CUDA the fused kernel: one launch per tensor list and no temporaries, where the
    # default multi-tensor path allocates whole-model intermediates (sqrt of exp_avg_sq, ...) that
    # cost as much memory as the fp32 parameters themselves.
    on_cuda = all(p.device.type == "cuda" for g in groups for p in g["params"])
    return torch.optim.AdamW(groups, lr=opt.lr, betas=opt.betas, eps=opt.eps,
                             fused=True if on_cuda else None)


def lr_factor(opt: OptimizerConfig, step: int) -> float:
    """Multiplier of ``opt.lr`` at optimizer step ``step`` (0-based): warm-up then schedule."""
    if step < opt.warmup_steps:
        return (step + 1) / opt.warmup_steps
    if opt.schedule == "constant":
        return 1.0
    span = max(opt.total_steps - opt.warmup_steps, 1)
    progress = min((step - opt.warmup_steps) / span, 1.0)
    shape = (1.0 - progress if opt.schedule == "linear"
             else 0.5 * (1.0 + math.cos(math.pi * progress)))
    return opt.min_lr_ratio + (1.0 - opt.min_lr_ratio) * shape


def build_scheduler(optimizer: torch.optim.Optimizer, opt: OptimizerConfig):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(opt, step))
