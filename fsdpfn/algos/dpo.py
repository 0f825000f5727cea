"""DPO on sequence log-prob sums (rows 2i chosen, 2i+1 rejected); needs ref_logp."""

from __future__ import annotations

import torch

from fsdpfn import keys as K
from fsdpfn.algos.common import check_config
from fsdpfn.config import DPOConfig
from fsdpfn.engine.objective import Objective
from fsdpfn.ops import dpo_loss_sum
from fsdpfn.engine.step import grad_step

__all__ = ["dpo_loss_fn", "dpo_objective", "dpo_step"]


def _seq_sums(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, x, torch.zeros((), device=x.device)).sum(-1).view(-1, 2)


def dpo_loss_fn(config: DPOConfig):
    """loss_fn for grad_step: ops.dpo_loss_sum on the sequence log-prob sums of each pair
    (loss_mask tokens) of the policy and ref_logp; grad_step divides by the global pair count."""

    def loss_fn(outputs, mb, ctx):
        mask = mb[K.LOSS_MASK]
        pi = _seq_sums(outputs[K.LOGP], mask)          # (pairs, 2)
        ref = _seq_sums(mb[K.REF_LOGP], mask)
        return dpo_loss_sum(pi[:, 0], pi[:, 1], ref[:, 0], ref[:, 1], beta=config.beta,
                            kind=config.kind)

    return loss_fn


def dpo_objective(config: DPOConfig = DPOConfig()) -> Objective:
    check_config(config, DPOConfig)
    why = {K.REF_LOGP: "the DPO reference; compute it with forward_logp(ref, batch, "
                       "out_key='ref_logp')"}
    return Objective(dpo_loss_fn(config), normalizer="pairs", require=(K.LOSS_MASK, K.REF_LOGP),
                     why=why, group_size=2, pairs=True, name="dpo_step", critic=False,
                     config=config)


def dpo_step(state, batch, config: DPOConfig = DPOConfig(), *, mb_spec=None):
    """One optimizer step of DPO, normalised by the global number of pairs; ``mb_spec``
    overrides the state's micro-batching for this call."""
    return grad_step(state, batch, dpo_objective(config), mb_spec=mb_spec)
