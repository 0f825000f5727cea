"""One file per algorithm: a loss factory plus a short ``*_step`` built on grad_step."""

from fsdpfn.algos.advantages import compute_advantages
from fsdpfn.algos.critic import critic_loss, critic_step
from fsdpfn.algos.dpo import dpo_loss_fn, dpo_step
from fsdpfn.algos.ppo import ppo_loss, ppo_step
from fsdpfn.algos.rw import rw_loss, rw_step
from fsdpfn.algos.sft import sft_loss_fn, sft_step

__all__ = ["compute_advantages", "ppo_step", "ppo_loss", "critic_step", "critic_loss", "sft_step",
           "sft_loss_fn", "rw_step", "rw_loss", "dpo_step", "dpo_loss_fn"]
