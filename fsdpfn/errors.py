"""Typed errors of fsdpfn.

Every message names the field or key, the rule, and the value received. After any of these is
raised, the state and the inputs are unchanged and still usable.
"""

from __future__ import annotations

__all__ = ["ConfigError", "BatchError", "StaleStateError", "WeightSyncError", "CheckpointError"]


class ConfigError(ValueError):
    """A configuration value breaks a rule (field, rule and value are in the message)."""


class BatchError(ValueError):
    """A batch breaks the public layout of API.md (key, rule and value are in the message)."""


class StaleStateError(RuntimeError):
    """A superseded (donated) EngineState was used, or its parameters changed outside fsdpfn."""


class WeightSyncError(RuntimeError):
    """Pushing weights to a rollout engine failed; the receiver keeps its previous weights."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupted or does not match the state."""
