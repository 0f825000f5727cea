"""The rollout server's one error type (re-exported by fsdpfn.rollout.engine), and the request
fields' rules more than one endpoint reads (flags, rid, timeout_s, group fields, temperature)."""

from __future__ import annotations

import math

# how the decode loop's refusal of a row past its positions names them; a client that describes
# the refusal (fsdpfn.app.recipes.workflow) finds it by this text, which crosses HTTP
PAST_POSITIONS = "(--decode-max-len)"

__all__ = ["UpdateError", "check_flags", "check_rid", "request_timeout", "group_name",
           "group_args", "check_temperature", "GREEDY_BELOW", "SEED_END", "PAST_POSITIONS"]

GREEDY_BELOW = 1e-6  # SGLang's rule: a temperature below it is greedy (fsdpfn.validators
# holds the trainer's side of it, TEMPERATURE_MIN; tests/unit/test_float_ranges.py: equal)
SEED_END = 2**63  # sampling seeds are ints in [0, SEED_END) (the trainer's validators.SEED_END)

# the bool fields of the update requests (SGLang's and fsdpfn's)
UPDATE_FLAGS = ("flush_cache", "merged_adapters", "verify_checksums", "commit",
                "abort_all_requests")


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


def check_temperature(value) -> float:
    """/forward's temperature: a finite number >= 1e-6 (the trainer's rule, the servers'
    greedy bound), else a 400 naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not GREEDY_BELOW <= value < math.inf:
        raise UpdateError(f"temperature: must be a finite number >= 1e-06 (a sampling "
                          f"temperature below it is greedy, whose log-probs are temperature "
                          f"1's), got {value!r}")
    return float(value)


def request_timeout(payload: dict) -> float:
    """An update request's ``timeout_s`` (300 s when absent or null), else a 400 naming it: a
    string, a NaN or an infinite bound was read as 300 s or as no bound at all."""
    timeout = payload.get("timeout_s")
    if timeout is None:
        return 300.0
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) \
            or not 0 < timeout < math.inf:
        raise UpdateError(f"timeout_s: must be a finite number of seconds > 0 (or null: 300), "
                          f"got {str(timeout)[:80]!r}")
    return float(timeout)


def group_name(payload: dict) -> str:
    """A request's ``group_name`` (SGLang's default when absent or null), else a 400 naming it."""
    name = payload.get("group_name")
    if name is None:
        return "weight_update_group"
    if not isinstance(name, str) or not name:
        raise UpdateError(f"group_name: must be a non-empty string, got {str(name)[:80]!r}")
    return name


def group_args(payload: dict) -> dict:
    """/init_weights_update_group's fields, each checked (a 400 naming the first that breaks its
    rule: read loosely, a port of 1.5 was port 1 and a null host "None", and the request then
    waited in the rendezvous for its whole timeout): make_group's keyword arguments."""
    missing = [k for k in ("master_address", "master_port", "rank_offset", "world_size")
               if payload.get(k) is None]
    if missing:
        raise UpdateError(f"{missing[0]}: required (init_weights_update_group takes "
                          f"master_address, master_port, rank_offset, world_size), got "
                          f"{sorted(payload)}")

    def whole(key, low, high=None):
        value = payload[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < low \
                or (high is not None and value > high):
            raise UpdateError(f"{key}: must be an int in [{low}, {high or 'inf'}], got "
                              f"{str(value)[:80]!r}")
        return value

    address, backend = payload["master_address"], payload.get("backend") or "nccl"
    if not isinstance(address, str) or not address.strip():
        raise UpdateError(f"master_address: must be a host name or address, got "
                          f"{str(address)[:80]!r}")
    if backend not in ("nccl", "gloo"):
        raise UpdateError(f"backend: must be 'nccl' or 'gloo', got {str(backend)[:80]!r}")
    args = dict(master_address=address, master_port=whole("master_port", 1, 65535),
                rank=whole("rank_offset", 0), world_size=whole("world_size", 2),
                group_name=group_name(payload), backend=backend,
                timeout_s=request_timeout(payload))
    if args["rank"] >= args["world_size"]:
        raise UpdateError(f"rank_offset: must be below world_size ({args['world_size']}), got "
                          f"{args['rank']}")
    return args
