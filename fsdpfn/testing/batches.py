"""Random batches in the public layout of docs/api.md, for tests of algorithms."""

from __future__ import annotations

import torch
from tensordict import TensorDict

from fsdpfn import keys as K
__all__ = ["random_batch", "with_ppo_keys"]


def random_batch(B: int, T: int, *, vocab_size: int = 128, seed: int = 0, min_len: int = 4,
                 prompt_len: int = 2, group_size: int = 1) -> TensorDict:
    """input_ids [B, T], attention_mask (random lengths in [min_len, T], right padded),
    loss_mask (tokens after the first ``prompt_len``), rewards [B].

    Rows of a group (``group_size`` consecutive rows) share their prompt, as in GRPO rollouts.
    """
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(min_len, T + 1, (B,), generator=g)
    ids = torch.randint(0, vocab_size, (B, T), generator=g)
    prompts = ids[::group_size, :prompt_len].repeat_interleave(group_size, 0)
    ids[:, :prompt_len] = prompts
    attn = torch.arange(T)[None] < lens[:, None]
    ids = torch.where(attn, ids, torch.zeros((), dtype=ids.dtype))
    loss = attn.clone()
    loss[:, :prompt_len] = False
    rewards = torch.rand(B, generator=g)
    return TensorDict({K.INPUT_IDS: ids, K.ATTENTION_MASK: attn, K.LOSS_MASK: loss,
                       K.REWARDS: rewards}, batch_size=[B])


def with_ppo_keys(batch: TensorDict, *, seed: int = 0) -> TensorDict:
    """``batch`` given old_logp and ref_logp in [-2, -1) and advantages ~ N(0, 1) on its loss
    tokens, 0 elsewhere (set in place; returned)."""
    B, T = batch[K.LOSS_MASK].shape
    g = torch.Generator().manual_seed(seed)
    lm, zero = batch[K.LOSS_MASK], torch.zeros(())
    batch[K.OLD_LOGP] = torch.where(lm, -torch.rand(B, T, generator=g) - 1.0, zero)
    batch[K.REF_LOGP] = torch.where(lm, -torch.rand(B, T, generator=g) - 1.0, zero)
    batch[K.ADVANTAGES] = torch.where(lm, torch.randn(B, T, generator=g), zero)
    return batch
