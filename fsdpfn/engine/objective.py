"""Objective: an algorithm as one value, the loss plus what running it needs.

    objective = ff.Objective(my_loss, normalizer="sequences", require=("loss_mask", "advantages"))
    actor, stats = ff.grad_step(actor, batch, objective)

``loss_fn(outputs, minibatch, ctx) -> (loss_sum, stats)`` as grad_step documents;
``normalizer`` the global count the loss sum is divided by ("tokens", "sequences", "rows",
"pairs", "none"); ``require`` the batch keys it reads (``why``: key -> a hint shown when one is
missing); ``group_size`` rows kept together in minibatches (GRPO groups, pairs: 2); ``pairs``:
rows 2i, 2i+1 are a (chosen, rejected) pair; ``with_entropy`` / ``temperature`` for the actor's
outputs; ``name`` the function named in errors. Every ``*_step`` of fsdpfn.algos builds one and
hands it to grad_step; a bare loss_fn with these as keywords still works.
"""

from __future__ import annotations

from typing import Callable

import attrs

from fsdpfn import keys as K
from fsdpfn.errors import ConfigError
from fsdpfn.validators import one_of, satisfies

__all__ = ["Objective", "NORMALIZERS", "as_objective"]

NORMALIZERS = ("tokens", "sequences", "rows", "pairs", "none")
# the options an Objective carries, with grad_step's keyword defaults
OPTIONS = {"normalizer": "tokens", "require": (K.LOSS_MASK,), "why": None, "group_size": 1,
           "pairs": False, "with_entropy": False, "temperature": 1.0}


_callable = satisfies("must be callable (outputs, minibatch, ctx) -> (loss_sum, stats)", callable,
                      show=lambda v: type(v).__name__)
_group = satisfies("must be an integer >= 1",
                   lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1)


@attrs.frozen
class Objective:
    """A loss and what grad_step needs to run it (module doc)."""

    loss_fn: Callable = attrs.field(validator=_callable)
    normalizer: str = attrs.field(default="tokens", validator=one_of(*NORMALIZERS))
    require: tuple[str, ...] = attrs.field(default=(K.LOSS_MASK,), converter=tuple)
    why: dict = attrs.field(factory=dict, converter=lambda v: dict(v or {}), eq=False)
    group_size: int = attrs.field(default=1, validator=_group)
    pairs: bool = False
    with_entropy: bool = False
    temperature: float = 1.0
    name: str = "grad_step"


def as_objective(loss, name: str | None, **options) -> Objective:
    """``loss`` as an Objective: itself (the keyword options must then be left at their
    defaults: they belong in the Objective), or a bare loss_fn with the keyword options."""
    if isinstance(loss, Objective):
        changed = [k for k, v in options.items() if v != OPTIONS[k]]
        if changed:
            raise ConfigError(f"{changed[0]}: set it in the Objective, not beside it, got "
                              f"{options[changed[0]]!r}")
        return loss if name is None else attrs.evolve(loss, name=name)
    return Objective(loss, name=name or "grad_step", **options)
