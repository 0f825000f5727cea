"""EngineState: a frozen handle with donation semantics.

A function that returns a new state *donates* the one it was given: the tensors inside advance in
place (FSDP2 owns them), so the old handle no longer describes them. Each state carries a lease; the
successor gets a new one and the old lease is revoked. Using a revoked state raises StaleStateError
naming the function and the likely bug. The lease also records every local parameter shard's
in-place version counter, so a parameter changed outside fsdpfn (``p.data.add_(...)``,
``torch.nn.init``...) is detected the next time the state is used.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import attrs
import torch
from torch import nn

from fsdpfn.agree import agree_on_error
from fsdpfn.config import EngineConfig
from fsdpfn.errors import StaleStateError
from fsdpfn.engine.mesh import Mesh

__all__ = ["EngineState", "Lease", "advance", "check_live", "local_tensor",
           "param_index"]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores (the local shard of a DTensor)."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t  # noqa: SLF001


class ParamIndex:
    """``model.named_parameters()`` (same names, order, and tied parameters once), remembered:
    walking the module tree costs about a millisecond for a 28-layer model, and a weight push
    or a liveness check needs the list every time. ``valid()`` checks that every parameter is
    still the one registered under its name (FSDP swaps sharded and unsharded parameters in and
    out of the modules), in one dict lookup per parameter. ``extra`` holds what callers derive
    from the list (dropped with it)."""

    def __init__(self, model: nn.Module):
        self.named: list[tuple[str, nn.Parameter]] = []
        self._slots: list[tuple[dict, str, nn.Parameter]] = []
        seen: set[int] = set()
        for prefix, module in model.named_modules():
            for key, p in module._parameters.items():  # noqa: SLF001
                if p is None or id(p) in seen:
                    continue
                seen.add(id(p))
                self._slots.append((module._parameters, key, p))  # noqa: SLF001
                self.named.append((f"{prefix}.{key}" if prefix else key, p))
        self.extra: dict[str, Any] = {}

    def valid(self) -> bool:
        return all(params.get(key) is p for params, key, p in self._slots)


_INDEX: "weakref.WeakKeyDictionary[nn.Module, ParamIndex]" = weakref.WeakKeyDictionary()


def param_index(model: nn.Module) -> ParamIndex:
    """The model's ParamIndex, rebuilt when a parameter was replaced."""
    index = _INDEX.get(model)
    if index is None or not index.valid():
        index = _INDEX[model] = ParamIndex(model)
    return index


def _param_versions(model: nn.Module) -> int:
    # the sum of in-place version counters of every local shard: any in-place write bumps it
    return sum(local_tensor(p)._version for _, p in param_index(model).named)  # noqa: SLF001


@attrs.define(eq=False)
class Lease:
    """Mutable validity record shared by nobody but its one state."""

    param_versions: int
    revoked_by: str | None = None
    revoked_at_step: int | None = None


@attrs.frozen(eq=False)
class EngineState:
    """config, mesh, sharded model, ``optimizer`` and LR ``scheduler`` (both None when
    inference-only), ``step`` (optimizer steps taken) and ``version`` (weights version).
    ``lr_scheduler`` is a deprecated alias of ``scheduler``.

    ``model`` is the engine's internal wrapper (fsdpfn.engine.packed.PackedModel), whose parameter
    names carry its ``lm.`` prefix; ``hf_model`` is the Hugging Face module inside it, sharded
    in place, whose ``named_parameters()`` and
    ``torch.distributed.checkpoint.state_dict.get_model_state_dict(state.hf_model)`` use
    Hugging Face's own names (``model.layers.0.self_attn.q_proj.weight``; with LoRA, peft's
    injected ``base_layer`` / ``lora_A`` / ``lora_B`` names).

    Frozen: functions that change weights return a successor and revoke this one.
    """

    config: EngineConfig
    mesh: Mesh
    model: nn.Module = attrs.field(repr=False)
    optimizer: torch.optim.Optimizer | None = attrs.field(repr=False)
    scheduler: Any = attrs.field(repr=False)
    step: int = 0
    version: int = 0
    hf_config: Any = attrs.field(default=None, repr=False)
    lease: Lease = attrs.field(default=None, repr=False)

    def __attrs_post_init__(self):
        if self.lease is None:
            object.__setattr__(self, "lease", Lease(_param_versions(self.model)))

    @property
    def lr_scheduler(self):
        """Deprecated alias of ``scheduler`` (the same object): use ``state.scheduler``."""
        warnings.warn("EngineState.lr_scheduler is deprecated: use EngineState.scheduler (the "
                      "same LR scheduler; None for inference-only states)", DeprecationWarning,
                      stacklevel=2)
        return self.scheduler

    @property
    def hf_model(self) -> nn.Module:
        """The Hugging Face model (``AutoModelForCausalLM``, or the token-classification critic)
        inside ``model``: the same sharded modules and parameters, under Hugging Face's names."""
        return self.model.lm

    @property
    def trainable(self) -> bool:
        return self.optimizer is not None

    @property
    def is_live(self) -> bool:
        return self.lease.revoked_by is None


def stale_reason(state: EngineState, fn_name: str) -> str | None:
    """Why ``state`` may not be used by ``fn_name`` (None when it may)."""
    if not isinstance(state, EngineState):
        return f"{fn_name}: state must be an EngineState, got {type(state).__name__}"
    lease = state.lease
    if lease.revoked_by is not None:
        return (f"{fn_name}: this EngineState (step {state.step}, version {state.version}) was "
                f"superseded by {lease.revoked_by}(), which returned its successor. Likely bug: "
                f"`new_state, stats = {lease.revoked_by}(state, ...)` followed by another call "
                f"with the old `state`; always rebind: `state, stats = {lease.revoked_by}(state, "
                f"...)`.")
    now = _param_versions(state.model)
    if now != lease.param_versions:
        return (f"{fn_name}: the parameters of this EngineState (step {state.step}, version "
                f"{state.version}) were changed in place outside fsdpfn (version counters "
                f"{lease.param_versions} -> {now}); weights must only change through fsdpfn "
                f"functions (grad_step, load_checkpoint, ...), so the version and the optimizer "
                f"state stay consistent.")
    return None


def check_live(state: EngineState, fn_name: str, *, local_error: BaseException | None = None,
               collective: bool = True) -> None:
    """Raise StaleStateError (or ``local_error``) on every rank if any rank finds a problem."""
    reason = stale_reason(state, fn_name)
    exc = StaleStateError(reason) if reason is not None else local_error
    agree_on_error(state.mesh if collective and isinstance(state, EngineState) else None, exc)


def record_own_writes(state: EngineState) -> None:
    """The fsdpfn function holding ``state`` wrote its weights in place (an optimizer step between
    the minibatches of one grad_step): the lease takes the new counters, so a later check in the
    same call still catches only writes from outside fsdpfn."""
    state.lease.param_versions = _param_versions(state.model)


def advance(state: EngineState, fn_name: str, *, steps: int = 0, weights_changed: bool = True,
            version: int | None = None, **changes) -> EngineState:
    """Return the successor of ``state`` and revoke ``state``.

    step advances by ``steps``; version by one when ``weights_changed`` (or is set to
    ``version``, which must not go backwards).
    """
    if version is None:
        version = state.version + int(weights_changed)
    assert version >= state.version, (version, state.version)
    successor = attrs.evolve(state, step=state.step + steps, version=version,
                             lease=Lease(_param_versions(state.model)), **changes)
    state.lease.revoked_by = fn_name
    state.lease.revoked_at_step = state.step
    return successor
