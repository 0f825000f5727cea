"""The JSON-over-HTTP client of the push, kept under its old path; it lives in fsdpfn.wire.http."""

from fsdpfn.wire.http import Call, call

__all__ = ["call", "Call"]
