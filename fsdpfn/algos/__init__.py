"""One file per algorithm: a loss factory, its Objective (the loss and what it reads) and a
short ``*_step`` handing the Objective to grad_step.

Names, per algorithm X in ppo, critic, sft, rw, dpo: ``X_loss_fn(config)`` returns the
``loss_fn(outputs, minibatch, ctx) -> (loss_sum, stats)`` that grad_step takes (a sum; grad_step
divides by the global count), ``X_objective(config)`` that loss with what running it needs, and
``X_step(state, batch, config)``. The tensor losses of fsdpfn.ops (``sft_loss``, ``dpo_loss``,
...) are the same math in mean form, on plain tensors. ``ppo_loss``, ``critic_loss`` and
``rw_loss`` are former names of the loss factories, kept as aliases."""

from fsdpfn.algos.advantages import compute_advantages
from fsdpfn.algos.critic import critic_loss, critic_loss_fn, critic_objective, critic_step
from fsdpfn.algos.dpo import dpo_loss_fn, dpo_objective, dpo_step
from fsdpfn.algos.ppo import ppo_loss, ppo_loss_fn, ppo_objective, ppo_step
from fsdpfn.algos.rw import rw_loss, rw_loss_fn, rw_objective, rw_step
from fsdpfn.algos.sft import sft_loss_fn, sft_objective, sft_step

__all__ = ["compute_advantages", "ppo_step", "ppo_loss_fn", "ppo_objective", "critic_step",
           "critic_loss_fn", "critic_objective", "sft_step", "sft_loss_fn", "sft_objective",
           "rw_step", "rw_loss_fn", "rw_objective", "dpo_step", "dpo_loss_fn", "dpo_objective",
           "ppo_loss", "critic_loss", "rw_loss"]
