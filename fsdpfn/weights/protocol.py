"""The wire and disk formats of a push, kept under their old path; they live in
fsdpfn.wire.protocol, which both the trainer and the rollout server import."""

from fsdpfn.wire.protocol import *  # noqa: F401,F403
from fsdpfn.wire.protocol import __all__, nbytes_of  # noqa: F401
