"""The rollout server's one error type (re-exported by fsdpfn.rollout.engine)."""

from __future__ import annotations

__all__ = ["UpdateError"]


class UpdateError(Exception):
    """A request the engine refuses; ``status`` is the HTTP status the server answers with."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status
