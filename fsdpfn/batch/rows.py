"""Rows of token ids laid out as the public batch (docs/api.md, Batch layout).

``pad_rows(rows, prompt_lens)``: input_ids, attention_mask and loss_mask (after each prompt).
``rollout_batch(prompts, outputs, group_size, rewards)`` lays out what a rollout server's
``generate`` (or ``generate_balanced``) returned for ``group_size`` samples of each prompt: one
row per answer, prompt-major (the samples of prompt k are rows ``[k*G, (k+1)*G)``), the prompt
followed by the sampled ids, right padded. ``loss_mask`` covers the sampled ids; ``behav_logp`` holds the
server's log-probs at their positions (0 elsewhere); ``group_id`` is the prompt's index, so
``shard_batch`` keeps a group on one rank; ``rewards`` is one float per row.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence

import torch
from tensordict import TensorDict

from fsdpfn import keys as K
from fsdpfn.errors import BatchError

__all__ = ["rollout_batch", "pad_rows"]


def pad_rows(rows: Sequence[Sequence[int]], prompt_lens: Sequence[int]) -> TensorDict:
    """input_ids, attention_mask (real tokens), loss_mask (the tokens after each row's prompt),
    right padded to the longest row."""
    T = max((len(r) for r in rows), default=0)
    B = len(rows)
    ids = torch.zeros(B, T, dtype=torch.int64)
    attn = torch.zeros(B, T, dtype=torch.bool)
    loss = torch.zeros(B, T, dtype=torch.bool)
    for i, (row, p) in enumerate(zip(rows, prompt_lens)):
        ids[i, :len(row)] = torch.tensor(list(row), dtype=torch.int64)
        attn[i, :len(row)] = True
        loss[i, p:len(row)] = True
    return TensorDict({K.INPUT_IDS: ids, K.ATTENTION_MASK: attn, K.LOSS_MASK: loss},
                      batch_size=[B])


def _answers(outputs) -> list:
    if isinstance(outputs, Mapping):  # generate()'s whole answer
        if "outputs" not in outputs:
            raise BatchError(f"outputs: must be generate()'s answer or its 'outputs' list, got "
                             f"a mapping with keys {sorted(outputs)}")
        outputs = outputs["outputs"]
    if isinstance(outputs, (str, bytes)) or not isinstance(outputs, Sequence):
        raise BatchError(f"outputs: must be a list of the server's answers, got "
                         f"{type(outputs).__name__}")
    return list(outputs)


def _seq(name: str, value, what: str) -> list:
    """``value`` as a list: a list, tuple or 1-D tensor or numpy array (not a str, bytes or
    mapping)."""
    if getattr(value, "ndim", None) == 1 and hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise BatchError(f"{name}: must be a list of {what}, got {type(value).__name__}")
    return list(value)


def _token_ids(name: str, value) -> list[int]:
    ids = _seq(name, value, "token ids")
    for j, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral) or t < 0:
            raise BatchError(f"{name}[{j}]: must be a token id (an int >= 0), got {t!r}")
    return [int(t) for t in ids]


def _finite(name: str, value, what: str) -> list[float]:
    out = _seq(name, value, what)
    for j, x in enumerate(out):  # a bool reward (a verifier's True) is 1.0
        if not isinstance(x, numbers.Real) or not math.isfinite(x):
            raise BatchError(f"{name}[{j}]: must be a finite number, got {x!r}")
    return [float(x) for x in out]


def rollout_batch(prompts: Sequence[Sequence[int]], outputs, group_size: int,
                  rewards: Sequence[float]) -> TensorDict:
    """The public batch of ``group_size`` answers to each of ``prompts``: ``outputs`` is
    generate()'s answer or its ``outputs`` list (each {output_ids, output_logprobs, ...}),
    prompt-major; ``rewards`` one float per answer. A count or a length that does not fit is a
    BatchError naming it."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise BatchError(f"group_size: must be an int >= 1, got {group_size!r}")
    answers = _answers(outputs)
    prompts = [_token_ids(f"prompts[{i}]", p)
               for i, p in enumerate(_seq("prompts", prompts, "prompts (token id lists)"))]
    if len(answers) != len(prompts) * group_size:
        raise BatchError(f"outputs: must hold group_size x len(prompts) = {group_size} x "
                         f"{len(prompts)} = {len(prompts) * group_size} answers (prompt-major), "
                         f"got {len(answers)}")
    rewards = _finite("rewards", rewards, "numbers, one per answer")
    if len(rewards) != len(answers):
        raise BatchError(f"rewards: must hold one reward per answer ({len(answers)}), got "
                         f"{len(rewards)}")
    rows, plens, logps = [], [], []
    for i, out in enumerate(answers):
        if not isinstance(out, Mapping) or "output_ids" not in out \
                or "output_logprobs" not in out:
            keys = sorted(out) if isinstance(out, Mapping) else type(out).__name__
            raise BatchError(f"outputs[{i}]: must hold output_ids and output_logprobs (ask the "
                             f"server for log-probs), got {keys}")
        ids = _token_ids(f"outputs[{i}].output_ids", out["output_ids"])
        lps = _finite(f"outputs[{i}].output_logprobs", out["output_logprobs"], "log-probs")
        if len(lps) != len(ids):
            raise BatchError(f"outputs[{i}].output_logprobs: must hold one log-prob per output "
                             f"id ({len(ids)}), got {len(lps)}")
        prompt = prompts[i // group_size]
        if not prompt:
            raise BatchError(f"prompts[{i // group_size}]: must hold at least one token, got []")
        rows.append(prompt + ids)
        plens.append(len(prompt))
        logps.append(lps)
    batch = pad_rows(rows, plens)
    behav = torch.zeros(batch[K.INPUT_IDS].shape, dtype=torch.float32)
    for i, (p, lps) in enumerate(zip(plens, logps)):
        behav[i, p:p + len(lps)] = torch.tensor(lps, dtype=torch.float32)
    batch.set(K.BEHAV_LOGP, behav)
    batch.set(K.REWARDS, torch.tensor(rewards, dtype=torch.float32))
    batch.set(K.GROUP_ID, torch.arange(len(answers), dtype=torch.int64) // group_size)
    return batch
