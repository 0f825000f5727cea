"""Typed errors of fsdpfn.

Every message names the field or key, the rule, and the value received. After any of these is
raised, the state and the inputs are unchanged and still usable.
"""

from __future__ import annotations

__all__ = ["ConfigError", "BatchError", "StaleStateError", "WeightSyncError", "CheckpointError",
           "MicroBatchOOMError"]


class ConfigError(ValueError):
    """A configuration value breaks a rule (field, rule and value are in the message)."""


class BatchError(ValueError):
    """A batch breaks the public layout of docs/api.md (key, rule and value are in the message)."""


class StaleStateError(RuntimeError):
    """A superseded (donated) EngineState was used, or its parameters changed outside fsdpfn."""


class WeightSyncError(RuntimeError):
    """Pushing weights to a rollout engine failed; the receiver keeps its previous weights."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupted or does not match the state."""


def _define_oom_error() -> type:
    """MicroBatchOOMError subclasses torch.OutOfMemoryError; it is defined on first use so
    that importing the other errors (every config check) does not import torch."""
    import torch

    class MicroBatchOOMError(torch.OutOfMemoryError):
        """A micro-batch ran out of device memory inside a forward or a step.

        Raised instead of torch's own error (a subclass of it, so
        ``except torch.OutOfMemoryError`` still catches it) after gradients were dropped and
        cached memory released: the state was not advanced and can be used again, e.g. with a
        smaller ``mb_spec=`` override.
        ``fn_name``, ``n_tokens`` (the micro-batch's tokens), ``max_tokens_per_mb`` (the budget in
        force, None for none) and ``state`` (None, or the successor state when earlier optimizer
        steps of the same call had already run) are attributes.
        """

        def __init__(self, message: str, *, fn_name: str = "", n_tokens: int = 0,
                     max_tokens_per_mb: int | None = None):
            super().__init__(message)
            self.fn_name = fn_name
            self.n_tokens = n_tokens
            self.max_tokens_per_mb = max_tokens_per_mb
            self.state = None  # the successor state, when earlier steps of the call did run

        def __reduce__(self):
            return (_rebuild_oom, (str(self), self.fn_name, self.n_tokens,
                                   self.max_tokens_per_mb))

    MicroBatchOOMError.__module__ = __name__
    MicroBatchOOMError.__qualname__ = "MicroBatchOOMError"
    return MicroBatchOOMError


def __getattr__(name: str):
    if name == "MicroBatchOOMError":
        if name not in globals():
            globals()[name] = _define_oom_error()
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _rebuild_oom(message, fn_name, n_tokens, max_tokens_per_mb):
    return __getattr__("MicroBatchOOMError")(message, fn_name=fn_name, n_tokens=n_tokens,
                              max_tokens_per_mb=max_tokens_per_mb)
