"""The attrs validators and converters every config uses.

A validator refuses a value with a ConfigError naming the field, the rule and the value
(``lr: must be > 0, got -1.0``); fsdpfn.serde prefixes the dotted path of a nested field
(``optimizer.lr: ...``). A config's own rule is written with ``satisfies`` (its rule text and
the test it applies), the common ones are the factories below:

    lr: float = attrs.field(default=1e-5, converter=to_float, validator=number(gt=0))
    dp: int = attrs.field(default=-1, validator=integer(1, allow=(-1,)))
    algo: str = attrs.field(default="lpt", validator=one_of("lpt", "kk", "ffd"))
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Callable, NoReturn

from fsdpfn.errors import ConfigError

__all__ = ["fail", "is_number", "is_nonempty_str", "is_port", "satisfies",
           "integer", "number", "one_of", "boolean", "str_tuple", "to_tuple", "to_float",
           "to_opt_float", "int_to_float", "to_path", "TEMPERATURE_MIN", "check_temperature",
           "temperature_rule", "FLOAT32_MAX", "fits_float32", "check_dir"]


def fail(name: str, rule: str, value: Any, *, shown: str | None = None) -> NoReturn:
    """Raise the ConfigError every validator raises: ``{name}: {rule}, got {value!r}``
    (``shown``: the text printed in place of the value's repr). A one-key mapping to None is
    how YAML reads a string ending in ':' (``workflow=agents.py:``), and the message says so."""
    hint = ""
    if isinstance(value, dict) and len(value) == 1:
        (k, v), = value.items()
        if v is None and isinstance(k, str):
            hint = (f" (YAML reads {k + ':'!r} as a mapping: a value ending in ':' lacks what "
                    f"follows the colon, or needs quotes)")
    raise ConfigError(f"{name}: {rule}, got {repr(value) if shown is None else shown}{hint}")


def is_number(value) -> bool:
    """A finite int or float (a bool is not a number here)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def is_nonempty_str(value) -> bool:
    """A str with at least one character."""
    return isinstance(value, str) and bool(value)


def is_port(value) -> bool:
    """An int (not a bool) in 0..65535 (0: a free port, as the OS picks one)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 65535


def satisfies(rule: str, ok: Callable[[Any], bool], *, optional: bool = False,
              section: str = "", show: Callable[[Any], Any] | None = None):
    """A validator refusing any value for which ``ok(value)`` is false, with ``rule`` as the
    message's rule. ``optional``: None passes; ``section``: a prefix of the field's name
    (``"data."``) for configs built outside fsdpfn.serde; ``show``: what the message prints in
    place of the value (``type(v).__name__`` for a callable)."""
    def check(_, attribute, value):
        if optional and value is None:
            return
        if not _holds(ok, value):
            fail(section + attribute.name, rule, value,
                 shown=None if show is None else str(show(value)))
    return check


def _holds(ok: Callable[[Any], bool], value) -> bool:
    """``ok(value)`` as a bool; a value the test cannot even be applied to (an array, whose
    ``in`` and truth are elementwise or ambiguous) does not satisfy it."""
    try:
        return bool(ok(value))
    except Exception:  # noqa: BLE001 - e.g. numpy's "truth value of an array is ambiguous"
        return False


def integer(lo: int | None = None, *, allow: tuple = ()):
    """An int (not a bool) >= ``lo``; the values in ``allow`` (None, -1, ...) pass as they are."""
    def check(_, attribute, value):
        if (value is None or isinstance(value, int) and not isinstance(value, bool)) \
                and value in allow:
            return
        if not isinstance(value, int) or isinstance(value, bool):
            fail(attribute.name, "must be an integer", value)
        if lo is not None and value < lo:
            fail(attribute.name, f"must be >= {lo}", value)
    return check


SEED_END = 2**63  # every seed's range, [0, 2**63): torch's generators, the servers' seeds


def seed_int(_, attribute, value) -> None:
    """A seed: an int (not a bool) in [0, 2**63), the range of the rollout servers' sampling
    seeds (torch's generators take it too); the seeds drawn from it wrap into it (derived_seed)."""
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < SEED_END:
        fail(attribute.name, "must be an int in [0, 2**63)", value)


def derived_seed(seed: int, k: int) -> int:
    """Seed number ``k`` drawn from ``seed`` (a step, a rank's part): seed * 1,000,003 + k,
    wrapped into [0, 2**63) (the same number wherever it did not overflow)."""
    return (int(seed) * 1_000_003 + int(k)) % SEED_END


def number(*, gt=None, ge=None, lt=None, le=None, optional: bool = False):
    """A finite number within the bounds given; ``optional``: None passes."""
    bounds = ((gt, ">", lambda v, b: v > b), (ge, ">=", lambda v, b: v >= b),
              (lt, "<", lambda v, b: v < b), (le, "<=", lambda v, b: v <= b))

    def check(_, attribute, value):
        if value is None and optional:
            return
        if not is_number(value):
            fail(attribute.name, "must be a finite number", value)
        for bound, sign, holds in bounds:
            if bound is not None and not holds(value, bound):
                fail(attribute.name, f"must be {sign} {bound}", value)
    return check


FLOAT32_MAX = 3.4028234663852886e38
# a setting the rewards, advantages or penalties are multiplied or shifted by in float32: larger
# makes them inf (rewards times reward_scale=1e300 are inf, their advantages NaN)
fits_float32 = satisfies(
    "must be within float32's range (|x| <= 3.4e38), where the rewards are computed",
    lambda v: abs(v) <= FLOAT32_MAX, optional=True)


TEMPERATURE_MIN = 1e-6  # below it a server's draw is greedy (SGLang's rule); logits / T overflow
TEMPERATURE_RULE = ("must be a finite number >= 1e-06 (a sampling temperature below it is greedy, "
                    "whose log-probs are temperature 1's)")


def check_temperature(value) -> float:
    """A temperature the log-probs are taken at, as a float: a finite number >= 1e-6. Below it
    the servers sample greedily (and report temperature 1's log-probs), and logits / T leave
    float32's range (T = 1e-300 is 0 in float32): the log-probs would be NaN or describe no
    draw."""
    if not is_number(value) or not value >= TEMPERATURE_MIN:
        fail("temperature", TEMPERATURE_RULE, value)
    return float(value)


temperature_rule = satisfies(TEMPERATURE_RULE, lambda v: is_number(v) and v >= TEMPERATURE_MIN)


def one_of(*choices, rule: str | None = None):
    """One of ``choices``; ``rule``: the message's rule when the list is not the clearest one."""
    return satisfies(rule or f"must be one of {list(choices)}", lambda v: v in choices)


boolean = satisfies("must be a bool", lambda v: isinstance(v, bool))
str_tuple = satisfies("must be a list of non-empty strings",
                      lambda v: isinstance(v, tuple) and all(isinstance(s, str) and s for s in v),
                      optional=True)


def to_tuple(value):
    """A list as a tuple (YAML and JSON give lists); anything else is left to the validator."""
    return tuple(value) if isinstance(value, list) else value


def to_float(value):
    """A number read from YAML as a float: YAML 1.1 reads ``1e-6`` as a string, and ints are
    accepted where floats are meant; anything else is left to the validator."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return int_to_float(value)


def to_opt_float(value):
    """``to_float``, None kept."""
    return None if value is None else to_float(value)


def int_to_float(value):
    """An int (not a bool) as a float, for Python callers; strings are left to the validator."""
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def check_dir(name: str, value) -> Path:
    """A directory argument (``root``, ``out_dir``) as a Path: a non-empty str or os.PathLike
    that is a directory or does not exist yet."""
    if not isinstance(value, (str, os.PathLike)) or not isinstance(os.fspath(value), str) \
            or not os.fspath(value).strip():
        fail(name, "must be a directory path (a non-empty str or os.PathLike)", value)
    if Path(value).exists() and not Path(value).is_dir():
        fail(name, "must be a directory (or not exist yet)", value,
             shown=f"{str(value)!r}, which is a file")
    return Path(value)


def to_path(value):
    """A str or os.PathLike as a pathlib.Path; anything else is left to the validator."""
    return Path(value) if isinstance(value, (str, os.PathLike)) else value
