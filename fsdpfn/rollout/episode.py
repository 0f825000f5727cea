"""Episodes: the model calls of one multi-turn rollout, and the training rows they become.

A turn is one completion exactly as the server produced it: the prompt's token ids (as the server
rendered them), the sampled ids, their ``behav_logp`` and the weights version of each. Training
never re-tokenizes text: rows are built from these ids alone.

Joining. Turn t+1 extends turn t when its prompt starts with turn t's prompt followed by turn t's
sampled tokens, token for token (a chat that appends a tool result or a user message to the
conversation so far). A chain of extending turns becomes one row: the last turn's prompt and
answer, with ``loss_mask`` on the tokens the model sampled (every turn's answer) and nowhere else
(the first prompt, tool outputs, environment messages and the chat template's framing between
turns get no loss). A turn that does not extend the context (a summarising agent, a truncated or
re-rendered history) starts a new row. Turns are joined in the order they were made; a turn may
extend any earlier open chain (an agent that interleaves two conversations).
"""

from __future__ import annotations

from typing import Sequence

import attrs

__all__ = ["Turn", "Row", "episode_rows"]


def _ints(value) -> list:
    return [int(v) for v in value]


@attrs.frozen
class Turn:
    """One completion: ``prompt_ids`` (as rendered by the server), ``output_ids`` (sampled),
    ``logprobs`` (their behav_logp), ``versions`` (the weights version of each sampled token),
    ``temperature`` (what the tokens were drawn at, 0 for greedy; None where the server did
    not say)."""

    prompt_ids: list = attrs.field(converter=_ints)
    output_ids: list = attrs.field(converter=_ints)
    logprobs: list = attrs.field(converter=lambda v: [float(x) for x in v])
    versions: list = attrs.field(converter=_ints)
    temperature: float | None = attrs.field(
        default=None, converter=lambda v: None if v is None else float(v))

    def __attrs_post_init__(self):
        n = len(self.output_ids)
        if not self.prompt_ids:
            raise ValueError("prompt_ids: must not be empty")
        if len(self.logprobs) != n or len(self.versions) != n:
            raise ValueError(f"logprobs / versions: need one per output token ({n}), got "
                             f"{len(self.logprobs)} / {len(self.versions)}")

    @property
    def context(self) -> list:
        return self.prompt_ids + self.output_ids


@attrs.frozen
class Row:
    """One training row: ``input_ids`` [T]; ``loss_mask`` [T] True on sampled tokens;
    ``behav_logp`` [T] (0 off the mask); ``versions`` [T] (-1 off the mask); ``turns``: the
    indices of the episode's turns it holds."""

    input_ids: list
    loss_mask: list
    behav_logp: list
    versions: list
    turns: tuple

    @property
    def oldest_version(self) -> int | None:
        sampled = [v for v, m in zip(self.versions, self.loss_mask) if m]
        return min(sampled) if sampled else None


def _extends(turn: Turn, row: Row) -> bool:
    n = len(row.input_ids)
    return len(turn.prompt_ids) >= n and turn.prompt_ids[:n] == row.input_ids


def _grow(row: Row | None, turn: Turn, index: int) -> Row:
    """``row`` (None: an empty one) continued by ``turn``, whose prompt extends it."""
    base = 0 if row is None else len(row.input_ids)
    framing = len(turn.prompt_ids) - base  # prompt tokens the model did not sample
    n = len(turn.output_ids)
    prev = row or Row([], [], [], [], ())
    return Row(turn.context,
               prev.loss_mask + [False] * framing + [True] * n,
               prev.behav_logp + [0.0] * framing + list(turn.logprobs),
               prev.versions + [-1] * framing + list(turn.versions),
               prev.turns + (index,))


def episode_rows(turns: Sequence[Turn]) -> list[Row]:
    """The rows of an episode (module doc), in the order their first turn was made."""
    rows: list[Row] = []
    for index, turn in enumerate(turns):
        # the longest open row this turn extends (a turn extends at most one chain's end)
        fits = [i for i, r in enumerate(rows) if _extends(turn, r)]
        if fits:
            best = max(fits, key=lambda i: len(rows[i].input_ids))
            rows[best] = _grow(rows[best], turn, index)
        else:
            rows.append(_grow(None, turn, index))
    return [r for r in rows if any(r.loss_mask)]
