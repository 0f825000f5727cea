"""The stages of a weight update on the server, each small: post the receives and unpack what
arrived (checks queued on the device), validate against the served model, swap the parameters in
(and back), wait for the checks. fsdpfn.rollout.updates composes them and commits.

Updates are staged: received tensors go into a staging dict (a second copy of the weights), are
validated against the served model (name known, shape, dtype, not given twice; at commit: every
parameter present, all finite), and only then swapped in under the model lock: each served
parameter is pointed at its received tensor (no copy; the old storage is freed).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from fsdpfn.rollout.errors import UpdateError
from fsdpfn.rollout.groups import retire_group
from fsdpfn.wire.protocol import (MANIFEST, broadcast, bucket_layout, dtype_from_name,
                                  dtype_name, flat_checksums, padded_size, sha256_of, wait_work,
                                  word_sums, zero_padding)

__all__ = ["Staging", "BucketLayout", "Layout", "validate", "staging_for", "torch_dtypes",
           "receive", "post_flat", "unpack_flat", "check_stream", "swap_in", "swap_back",
           "events_done", "wait_events", "version_of", "record_event", "read_json",
           "load_safetensors", "check_manifest", "MANIFEST"]


class Staging:
    def __init__(self, update_id: str | None):
        self.update_id = update_id
        self.tensors: dict[str, torch.Tensor] = {}
        self.next_bucket = 0
        self.order_error: str | None = None
        # queued on the device per bucket, read at commit: (names, int64 checksums), bool flags
        self.sums: list[tuple[list[str], torch.Tensor]] = []
        self.finite: list[torch.Tensor] = []


class BucketLayout:
    """One flat bucket of a whole update: names, dtypes, shapes, and where each tensor lies."""

    def __init__(self, names: list[str], dtypes: list[str], shapes: list[list[int]]):
        self.names, self.dtypes, self.shapes = names, dtypes, shapes
        try:
            self.torch_dtypes = [dtype_from_name(d) for d in dtypes]
        except ValueError as exc:
            error = UpdateError(f"dtypes: {exc}")
            error.unsized = True  # the bytes on the wire cannot be sized
            raise error from None
        self.offsets, self.total = bucket_layout(dtypes, shapes)
        self.sizes = [math.prod(s) * d.itemsize for d, s in zip(self.torch_dtypes, shapes)]
        self.strides = self.elements = None
        if len(set(self.torch_dtypes)) == 1:
            size = self.torch_dtypes[0].itemsize
            self.elements = [o // size for o in self.offsets]
            self.strides = [torch.empty(s, device="meta").stride() for s in shapes]


class Layout:
    """A whole update's buckets, parsed and checked against the served model once (the update
    channel keeps it per connection and layout id, so a repeated push re-parses nothing).
    ``problems``: why it cannot be committed (unknown names, shapes, dtypes, a tensor twice, a
    served parameter missing), empty when it can."""

    def __init__(self, engine, buckets_json):
        try:
            parsed = [([str(n) for n in b["names"]], [str(d) for d in b["dtypes"]],
                       [[int(x) for x in s] for s in b["shapes"]]) for b in buckets_json]
        except (KeyError, TypeError, ValueError) as exc:
            raise UpdateError(f"update_weights_from_distributed: buckets must be a list of "
                              f"{{names, dtypes, shapes}}; got {str(buckets_json)[:120]} "
                              f"({type(exc).__name__}: {exc})") from None
        if not parsed or any(not (len(n) == len(d) == len(s)) for n, d, s in parsed):
            raise UpdateError("buckets: must be a non-empty list, with names, dtypes, shapes of "
                              "equal lengths in every bucket")
        self.buckets = [BucketLayout(*b) for b in parsed]
        names = [n for b in self.buckets for n in b.names]
        self.problems = validate(
            engine, names, [d for b in self.buckets for d in b.torch_dtypes],
            [s for b in self.buckets for s in b.shapes], Staging(None))
        sent = {engine.aliases.get(n, n) for n in names}
        missing = [n for n in engine.params if n not in sent]
        if missing:
            self.problems.append(f"every parameter of the served model must be sent, got none "
                                 f"for {len(missing)} (e.g. {missing[:3]})")
        self.canonical = [[engine.aliases.get(n, n) for n in b.names] for b in self.buckets]
        self.nbytes = sum(b.total for b in self.buckets)


def validate(engine, names, dtypes, shapes, staging: Staging) -> list[str]:
    problems = [staging.order_error] if staging.order_error else []
    seen = set(staging.tensors)
    unknown = []
    for name, dtype, shape in zip(names, dtypes, shapes):
        canonical = engine.aliases.get(name, name)
        param = engine.params.get(canonical)
        if param is None:
            unknown.append(name)
        elif list(param.shape) != list(shape):
            problems.append(f"tensor {name!r}: shape must equal the served "
                            f"{list(param.shape)}, got {list(shape)}")
        elif dtype != param.dtype:
            problems.append(f"tensor {name!r}: dtype must equal the served "
                            f"{dtype_name(param.dtype)}, got {dtype_name(dtype)}")
        if canonical in seen:
            problems.append(f"tensor {name!r}: must be sent once per update, got it again")
        seen.add(canonical)
    if unknown:
        problems.insert(0, f"tensor {unknown[0]!r}: name must be a parameter of the served "
                           f"model, got {len(unknown)} unknown name(s) {unknown[:4]}"
                           f"{' ...' if len(unknown) > 4 else ''} (served names look like "
                           f"{next(iter(engine.params))!r})")
    return problems[:8] + ([f"... {len(problems) - 8} more"] if len(problems) > 8 else [])


def staging_for(engine, update_id, bucket_index: int) -> Staging:
    current = engine._staging
    if update_id is None:
        return Staging(None)
    if current is None or current.update_id != update_id:
        current = engine._staging = Staging(update_id)  # a new update drops an abandoned one
    if bucket_index != current.next_bucket:
        engine._staging = None
        # still receive the bytes (keeps the group in step), then reject
        bad = Staging(update_id)
        bad.order_error = (f"bucket_index: must be {current.next_bucket} (the next bucket "
                           f"of update {update_id!r}), got {bucket_index}")
        return bad
    return current


def torch_dtypes(engine, dtypes: list[str], group_name: str) -> list[torch.dtype]:
    try:
        return [dtype_from_name(d) for d in dtypes]
    except ValueError as exc:
        # the bytes on the wire cannot be sized: the group is out of step, drop it
        retire_group(engine, group_name)
        raise UpdateError(f"dtypes: {exc}; group {group_name!r} dropped, "
                          f"re-initialise it") from None


def receive(engine, group_name, flat, dtypes, torch_dtypes, shapes):
    """(tensors, their int64 checksums, a bool "all finite"), the checks queued on the
    device, not read."""
    store, pg, backend, timeout_s = engine._groups[group_name]
    device = engine.device if backend == "nccl" else torch.device("cpu")
    try:
        if flat:
            bucket = BucketLayout([""] * len(dtypes), list(dtypes), shapes)
            buf, work = post_flat(pg, device, bucket.total)
            wait_work(work, backend, timeout_s)
            return unpack_flat(buf.to(engine.device), bucket)
        out = []
        for d, s in zip(torch_dtypes, shapes):
            t = torch.empty(s, dtype=d, device=device)
            wait_work(broadcast(pg, t), backend, timeout_s)
            out.append(t)
    except Exception as exc:  # noqa: BLE001 - a dead or stalled sender: gloo/nccl errors
        retire_group(engine, group_name)
        raise UpdateError(f"receiving over group {group_name!r} failed: "
                          f"{type(exc).__name__}: {exc}; group dropped, previous weights "
                          f"kept", 500) from None
    out = [t.to(engine.device) for t in out]
    sums = word_sums(out) if out else \
        torch.zeros(0, dtype=torch.int64, device=engine.device)
    finite = torch.stack([torch.isfinite(t).all() for t in out]).all() if out else \
        torch.ones((), dtype=torch.bool, device=engine.device)
    return out, sums, finite


def post_flat(pg, device, total: int):
    """Allocate a padded flat bucket of ``total`` bytes and post its receive; (buffer,
    work)."""
    buf = torch.empty(padded_size(total), dtype=torch.uint8, device=device)
    return buf, broadcast(pg, buf[:total])


def unpack_flat(buf, b: "BucketLayout"):
    """A received flat bucket -> (tensor views, int64 checksums, bool "all finite"); the
    checks are queued on the device (on the current stream), not read."""
    buf[b.total:].zero_()
    zero_padding(buf, b.offsets, b.sizes)
    if b.strides is not None:  # one dtype: one typed view, then a strided view per tensor
        typed = buf.view(b.torch_dtypes[0])
        out = [typed.as_strided(s, st, e) for s, st, e in zip(b.shapes, b.strides,
                                                               b.elements)]
    else:
        out = [buf[o:o + n].view(d).view(s)
               for o, n, d, s in zip(b.offsets, b.sizes, b.torch_dtypes, b.shapes)]
    sums = flat_checksums(buf, b.offsets, b.sizes)
    if b.strides is not None and b.total % b.torch_dtypes[0].itemsize == 0:
        # padding is zero: one sum of the whole bucket is NaN or inf when any value is (and,
        # rarely, when finite values overflow it: the caller then looks value by value).
        # A reduction runs at the memory's speed; isfinite(...).all() at a third of it.
        dtype = b.torch_dtypes[0]
        finite = torch.isfinite(buf[:b.total].view(dtype).sum(
            dtype=torch.float64 if dtype == torch.float64 else torch.float32))
    else:
        finite = torch.stack([torch.isfinite(t).all() for t in out]).all()
    return out, sums, finite


def check_stream(engine):
    if engine._stream is None:
        engine._stream = torch.cuda.Stream(engine.device)
    return engine._stream


def swap_in(engine, tensors: dict[str, torch.Tensor], previous: dict) -> None:
    """Point each served parameter at its received tensor (model lock held); ``previous``
    gets what they pointed at."""
    for name, t in tensors.items():
        param = engine.params[name]
        previous[name] = param.data
        param.data = t


def swap_back(engine, previous: dict) -> None:
    for name, t in previous.items():
        engine.params[name].data = t
    previous.clear()


def events_done(events, until: float) -> bool:
    """Whether every event completes before the monotonic time ``until`` (polled)."""
    for event in events:
        while not event.query():
            if time.monotonic() > until:
                return False
            time.sleep(2e-5)
    return True


def wait_events(events, timeout_s: float, *, quiet: bool = False) -> None:
    """Poll each bucket's "checked" event in turn, each within ``timeout_s`` of the one before
    (the host is free meanwhile); TimeoutError after that, or nothing when ``quiet``."""
    for event in events:
        if not events_done([event], time.monotonic() + timeout_s):
            if quiet:
                return
            raise TimeoutError(f"a bucket did not arrive within {timeout_s:g} s")


def version_of(payload: dict, default):
    """``weight_version`` of an update request as an int: an int, or (SGLang sends strings) a
    string of one; ``default`` when absent."""
    value = payload.get("weight_version")
    if value is None:
        return default
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise UpdateError(f"weight_version: must be an int or a string of one (fsdpfn "
                          f"versions count weight changes), got {value!r}")
    return value


def record_event(stream, timing: bool):
    event = torch.cuda.Event(enable_timing=timing)
    event.record(stream)
    return event


def read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    with open(path) as fh:
        return json.load(fh)


def load_safetensors(path: Path, device: torch.device) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UpdateError(f"model_path: must hold *.safetensors files, got none in "
                          f"{str(path)!r}", 404)
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(load_file(str(file), device=str(device)))
    return tensors


def check_manifest(manifest: dict, tensors: dict[str, torch.Tensor]) -> list[str]:
    problems = []
    expected = manifest.get("tensors", {})
    if sorted(expected) != sorted(tensors):
        problems.append(f"files: must hold exactly the manifest's {len(expected)} tensors, got "
                        f"{len(tensors)}")
    for name, entry in expected.items():
        t = tensors.get(name)
        if t is not None and sha256_of(t) != entry.get("sha256"):
            problems.append(f"tensor {name!r}: sha256 must equal the manifest's, got a "
                            f"different digest (corrupted or partly written file)")
    return problems
