"""The rollout server's one error type (re-exported by fsdpfn.rollout.engine)."""

from __future__ import annotations

__all__ = ["UpdateError", "check_flags", "check_rid"]

# the bool fields of the update requests (SGLang's and fsdpfn's)
UPDATE_FLAGS = ("flush_cache", "merged_adapters", "verify_checksums", "commit")


class UpdateError(Exception):
    """A request the engine refuses; ``status`` is the HTTP status the server answers with."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def check_flags(payload: dict, keys=UPDATE_FLAGS) -> None:
    """Each of ``keys`` the request sets is a JSON bool (null: the default), else a 400 naming
    it: read as Python truth, the string "false" committed an update meant to be staged."""
    for key in keys:
        value = payload.get(key)
        if value is not None and not isinstance(value, bool):
            raise UpdateError(f"{key}: must be a bool (true or false), got {str(value)[:80]!r}")


def check_rid(rid, each: str) -> None:
    """SGLang's ``rid``, what /abort_request names: None, a string, or a list of strings (one
    per ``each``: output, choice), else a 400 naming it."""
    if not (rid is None or isinstance(rid, str)
            or (isinstance(rid, list) and all(isinstance(r, str) for r in rid))):
        raise UpdateError(f"rid: must be a string (or a list of them, one per {each}), got "
                          f"{repr(rid)[:80]}")
