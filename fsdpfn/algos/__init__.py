"""One file per algorithm: a loss factory, its Objective (the loss and what it reads) and a
short ``*_step`` handing the Objective to grad_step."""

from fsdpfn.algos.advantages import compute_advantages
from fsdpfn.algos.critic import critic_loss, critic_objective, critic_step
from fsdpfn.algos.dpo import dpo_loss_fn, dpo_objective, dpo_step
from fsdpfn.algos.ppo import ppo_loss, ppo_objective, ppo_step
from fsdpfn.algos.rw import rw_loss, rw_objective, rw_step
from fsdpfn.algos.sft import sft_loss_fn, sft_objective, sft_step

__all__ = ["compute_advantages", "ppo_step", "ppo_loss", "ppo_objective", "critic_step",
           "critic_loss", "critic_objective", "sft_step", "sft_loss_fn", "sft_objective",
           "rw_step", "rw_loss", "rw_objective", "dpo_step", "dpo_loss_fn", "dpo_objective"]
