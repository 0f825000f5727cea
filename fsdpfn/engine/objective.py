"""Objective: an algorithm as one value, the loss plus what running it needs.

    objective = ff.Objective(my_loss, normalizer="sequences", require=("loss_mask", "advantages"))
    actor, stats = ff.grad_step(actor, batch, objective)

``loss_fn(outputs, minibatch, ctx) -> (loss_sum, stats)`` as grad_step documents;
``normalizer`` the global count the loss sum is divided by ("tokens", "sequences", "rows",
"pairs", "none"); ``require`` the batch keys it reads (``why``: key -> a hint shown when one is
missing); ``group_size`` rows kept together in minibatches (GRPO groups, pairs: 2); ``pairs``:
rows 2i, 2i+1 are a (chosen, rejected) pair; ``with_entropy`` / ``temperature`` for the actor's
outputs; ``name`` the function named in errors; ``critic`` the kind of state it runs on (True:
critic states, EngineConfig(is_critic=True); False: policy states; None: either), checked before
anything runs; ``config`` the settings behind loss_fn (a step's PPOConfig, ...), compared
over the ranks with the call's other options. Every ``*_step`` of fsdpfn.algos builds one and
hands it to grad_step; a bare loss_fn is an Objective with these at their defaults (grad_step
and evaluate take no option beside the loss: it is set here, once).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import attrs

from fsdpfn import keys as K
from fsdpfn.errors import ConfigError
from fsdpfn.validators import boolean, is_nonempty_str, one_of, satisfies, temperature_rule

__all__ = ["Objective", "NORMALIZERS", "as_objective", "check_actor_options"]

NORMALIZERS = ("tokens", "sequences", "rows", "pairs", "none")


_callable = satisfies("must be callable (outputs, minibatch, ctx) -> (loss_sum, stats)", callable,
                      show=lambda v: type(v).__name__)
_group = satisfies("must be an integer >= 1",
                   lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1)


def _keys(value) -> tuple[str, ...]:
    """``require`` as a tuple of key names; a bare string is refused (tuple() would split it
    into characters, each then a missing key)."""
    if isinstance(value, str) or not hasattr(value, "__iter__"):
        raise ConfigError(f"require: must be a sequence of batch key names (one key: "
                          f"({value!r},)), got {value!r}")
    keys = tuple(value)
    if not all(is_nonempty_str(k) for k in keys):
        raise ConfigError(f"require: must hold non-empty key names, got {list(keys)!r}")
    return keys


@attrs.frozen
class Objective:
    """A loss and what grad_step needs to run it (module doc)."""

    loss_fn: Callable = attrs.field(validator=_callable)
    # every option is keyword-only, as docs/api.md gives the signature
    normalizer: str = attrs.field(default="tokens", validator=one_of(*NORMALIZERS), kw_only=True)
    require: tuple[str, ...] = attrs.field(default=(K.LOSS_MASK,), converter=_keys, kw_only=True)
    why: dict = attrs.field(default=None, converter=lambda v: dict(v or {}), eq=False,
                            kw_only=True)
    group_size: int = attrs.field(default=1, validator=_group, kw_only=True)
    pairs: bool = attrs.field(default=False, validator=boolean, kw_only=True)
    with_entropy: bool = attrs.field(default=False, validator=boolean, kw_only=True)
    temperature: float = attrs.field(default=1.0, validator=temperature_rule, kw_only=True)
    name: str = attrs.field(default="grad_step", validator=satisfies(
        "must be a non-empty string", is_nonempty_str), kw_only=True)
    critic: bool | None = attrs.field(default=None, validator=one_of(None, True, False),
                                      kw_only=True)
    # the settings behind loss_fn (a step's PPOConfig, ...): compared over the ranks, field by
    # field, with the call's other options, so a config that differs by rank is one clear error
    config: Any = attrs.field(default=None, eq=False, kw_only=True)

    def __attrs_post_init__(self):
        if self.critic:
            check_actor_options(self, "critic=True")


    @property
    def unit(self) -> int:
        """Rows kept together in minibatches and micro-batches: ``group_size``, and with
        ``pairs`` whole pairs too (the least common multiple with 2: a pair objective of
        ``group_size=1`` moves its rows two by two)."""
        return math.lcm(self.group_size, 2) if self.pairs else self.group_size


def check_actor_options(objective: Objective, why: str) -> None:
    """``with_entropy`` and ``temperature`` shape a policy's outputs: with a critic (``why``)
    they would be dropped, so they are refused."""
    if objective.with_entropy:
        raise ConfigError(f"with_entropy: applies to policy states (a critic's outputs have no "
                          f"entropy), and {why}, got True")
    if objective.temperature != 1.0:
        raise ConfigError(f"temperature: applies to policy states (a critic's values take no "
                          f"temperature), and {why}, got {objective.temperature!r}")


def as_objective(loss, name: str | None = None) -> Objective:
    """``loss`` as an Objective: itself, or a bare loss_fn with the default options; ``name``
    (evaluate's) replaces the function named in errors."""
    objective = loss if isinstance(loss, Objective) else Objective(loss)
    return objective if name is None else attrs.evolve(objective, name=name)
