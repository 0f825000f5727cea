"""The stages of a weight update on the server, each a plain function of what it is given (the
served parameters, a process group, the received bytes): parse and validate the layout, receive
the bytes (SGLang's packed buckets or per-tensor broadcasts; fsdpfn's aligned buckets, their
checks queued on the device), read a version, load and verify files, the weights checksum of
what arrived or will be served. fsdpfn.rollout.receiver
composes them; nothing here holds state.

Received tensors are a second copy of the weights, validated against the served model (name
known, shape, dtype, not given twice; for a whole update: every parameter present, all finite)
before the engine swaps them in (RolloutEngine.swap).
"""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path

import torch

from fsdpfn.rollout.errors import UpdateError, request_timeout
from fsdpfn.wire.protocol import (MANIFEST, bucket_layout, broadcast, combine_checksums,
                                  combine_on_device, dtype_from_name, dtype_name, flat_checksums,
                                  padded_size, sha256_of, tensor_checksums, wait_work,
                                  zero_padding)

__all__ = ["BucketLayout", "Layout", "validate", "torch_dtypes", "receive_sglang", "post_flat",
           "unpack_flat", "copy_shared", "events_done", "wait_events", "parse_version",
           "record_event", "read_json", "load_safetensors", "check_manifest", "first_non_finite",
           "Abandoned", "wait_work_or_abandon", "manifest_version", "swap_bound", "http_swap_s",
           "request_fields", "checked_checksum", "checksum_after", "load_update_files"]


def torch_dtypes(dtypes: list[str]) -> list[torch.dtype]:
    """The torch dtypes of dtype names; an UpdateError marked ``unsized`` (the bytes on the wire
    cannot be sized, so the group is out of step) for an unknown one."""
    try:
        return [dtype_from_name(d) for d in dtypes]
    except ValueError as exc:
        error = UpdateError(f"dtypes: {exc}")
        error.unsized = True
        raise error from None


class BucketLayout:
    """One aligned flat bucket of a whole update: names, dtypes, shapes, where each tensor lies."""

    def __init__(self, names: list[str], dtypes: list[str], shapes: list[list[int]]):
        self.names, self.dtypes, self.shapes = names, dtypes, shapes
        self.torch_dtypes = torch_dtypes(dtypes)
        self.offsets, self.total = bucket_layout(dtypes, shapes)
        self.sizes = [math.prod(s) * d.itemsize for d, s in zip(self.torch_dtypes, shapes)]
        self.strides = self.elements = None
        if len(set(self.torch_dtypes)) == 1:
            size = self.torch_dtypes[0].itemsize
            self.elements = [o // size for o in self.offsets]
            self.strides = [torch.empty(s, device="meta").stride() for s in shapes]


class Layout:
    """A whole update's buckets, parsed and checked against the served model (``params``,
    ``aliases``) once (the update channel keeps it per connection and layout id).
    ``problems``: why it cannot be committed, empty when it can."""

    def __init__(self, params: dict, aliases: dict, buckets_json):
        try:
            parsed = [([str(n) for n in b["names"]], [str(d) for d in b["dtypes"]],
                       [[int(x) for x in s] for s in b["shapes"]]) for b in buckets_json]
        except (KeyError, TypeError, ValueError) as exc:
            raise UpdateError(f"buckets: must be a list of {{names, dtypes, shapes}}; got "
                              f"{str(buckets_json)[:120]} ({type(exc).__name__}: {exc})") from None
        if not parsed or any(not (len(n) == len(d) == len(s)) for n, d, s in parsed):
            raise UpdateError("buckets: must be a non-empty list, with names, dtypes, shapes of "
                              "equal lengths in every bucket")
        self.buckets = [BucketLayout(*b) for b in parsed]
        names = [n for b in self.buckets for n in b.names]
        self.problems = validate(params, aliases, names,
                                 [d for b in self.buckets for d in b.torch_dtypes],
                                 [s for b in self.buckets for s in b.shapes], whole=True)
        self.canonical = [[aliases.get(n, n) for n in b.names] for b in self.buckets]


def validate(params: dict, aliases: dict, names, dtypes, shapes, *, whole: bool) -> list[str]:
    """Why these tensors cannot replace served ones (empty: they can): unknown names, shapes or
    dtypes unlike the served, a tensor twice, and with ``whole`` a served parameter missing."""
    problems, seen, unknown = [], set(), []
    for name, dtype, shape in zip(names, dtypes, shapes):
        canonical = aliases.get(name, name)
        param = params.get(canonical)
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
                           f"{next(iter(params))!r})")
    missing = [n for n in params if n not in seen] if whole else []
    if missing:
        problems.append(f"every parameter of the served model must be sent, got none for "
                        f"{len(missing)} (e.g. {missing[:3]})")
    return problems[:8] + ([f"... {len(problems) - 8} more"] if len(problems) > 8 else [])


def receive_sglang(pg, backend: str, timeout_s: float, device: torch.device, packed: bool,
                   dtypes: list[torch.dtype], shapes: list[list[int]]) -> list[torch.Tensor]:
    """The tensors of one /update_weights_from_distributed request as SGLang sends them: with
    ``packed`` (load_format "flattened_bucket") ONE broadcast of the tensors flattened and
    concatenated, no padding (SGLang's FlattenedTensorBucket), else one broadcast per tensor,
    in order. Over gloo the bytes land on the CPU and are moved to ``device``."""
    wire = device if backend == "nccl" else torch.device("cpu")
    if packed:
        numels = [math.prod(s) for s in shapes]
        flat = torch.empty(sum(numels), dtype=dtypes[0], device=wire)
        wait_work(broadcast(pg, flat), backend, timeout_s)
        return [part.view(s).to(device) for part, s in zip(flat.split(numels), shapes)]
    out = []
    for dtype, shape in zip(dtypes, shapes):
        t = torch.empty(shape, dtype=dtype, device=wire)
        wait_work(broadcast(pg, t), backend, timeout_s)
        out.append(t.to(device))
    return out


def post_flat(pg, device, total: int):
    """Allocate a padded aligned bucket of ``total`` bytes and post its receive; (buffer,
    work)."""
    buf = torch.empty(padded_size(total), dtype=torch.uint8, device=device)
    return buf, broadcast(pg, buf[:total])


def unpack_flat(buf, b: BucketLayout):
    """A received aligned bucket -> (tensor views, int64 checksums, bool "all finite"); the
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


def copy_shared(handle, b: BucketLayout, device: torch.device):
    """A shared aligned flat bucket (fsdpfn.wire.ipc handle) copied into a buffer of this
    process, then unpacked and checked as unpack_flat does (views, checksums, finite), not
    read."""
    from fsdpfn.wire.ipc import open_shared

    try:
        shared = open_shared(handle or {}, device)
    except (ValueError, RuntimeError) as exc:
        raise UpdateError(f"update rejected, previous weights kept: {exc}") from None
    if shared.numel() < b.total:
        raise UpdateError(f"update rejected, previous weights kept: handle: the shared buffer "
                          f"holds {shared.numel()} bytes and its bucket's tensors {b.total}")
    own = torch.empty(padded_size(b.total), dtype=torch.uint8, device=device)
    own[:b.total].copy_(shared[:b.total])
    del shared
    return unpack_flat(own, b)


def first_non_finite(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The names (up to 3) of tensors holding NaN or inf (one device read for all)."""
    if not tensors:
        return []
    flags = torch.stack([torch.isfinite(t).all() for t in tensors.values()]).tolist()
    return [n for n, ok in zip(tensors, flags) if not ok][:3]


def events_done(events, until: float, abandoned=None) -> bool:
    """Whether every event completes before the monotonic time ``until`` (polled);
    ``abandoned()`` true meanwhile raises Abandoned."""
    polls = 0
    for event in events:
        while not event.query():
            if time.monotonic() > until:
                return False
            polls += 1
            if abandoned is not None and polls % 256 == 0 and abandoned():
                raise Abandoned("the sender abandoned the update (its channel closed)")
            time.sleep(2e-5)
    return True


class Abandoned(RuntimeError):
    """The sender of an update gave it up while this side waited for its bytes."""


def wait_events(events, timeout_s: float, abandoned=None) -> None:
    """Poll each bucket's "checked" event in turn, each within ``timeout_s`` of the one before
    (the host is free meanwhile); TimeoutError after that, Abandoned once ``abandoned()``."""
    for event in events:
        if not events_done([event], time.monotonic() + timeout_s, abandoned):
            raise TimeoutError(f"a bucket did not arrive within {timeout_s:g} s")


def wait_work_or_abandon(work, backend: str, timeout_s: float, abandoned=None) -> None:
    """wait_work, polled so that ``abandoned()`` (the sender closed its channel) ends the wait
    at once with Abandoned instead of at the timeout."""
    if abandoned is None:
        wait_work(work, backend, timeout_s)
        return
    deadline = time.monotonic() + timeout_s
    while not work.is_completed():
        if abandoned():
            raise Abandoned("the sender abandoned the update (its channel closed)")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the transfer did not complete within {timeout_s:g} s")
        time.sleep(0.001)
    work.wait()


def record_event(stream):
    event = torch.cuda.Event()
    event.record(stream)
    return event


def parse_version(value, current: int, current_label: str, *,
                  partial: bool = False) -> tuple[int, str | None]:
    """(fsdpfn's integer version, the label to report) of an update's ``weight_version``.

    fsdpfn counts weight changes with an int; SGLang takes any string as a label. An int, or a
    string of one, is the version itself (a string spelling it otherwise, "05", is kept as its
    label, as SGLang keeps the string it is given). Any other string is a label:
    the version moves on by one. Only a ``partial`` update (SGLang's request of some tensors)
    keeps the served version: when it names the label served now (a trainer sending the buckets
    of one version in several requests, each naming it), or names none (SGLang's rule: a
    request without weight_version leaves the version alone, so a push that fails half way
    never labels its part with a version of its own). None on a whole update: one more, no
    label."""
    if value is None:
        if partial:
            return current, (None if current_label == str(current) else current_label)
        return current + 1, None
    if isinstance(value, str) and re.fullmatch(r"\s*-?[0-9]+\s*", value):
        number = int(value)
        if number < 0:
            raise UpdateError(f"weight_version: must be >= 0 (a version counts weight "
                              f"changes), got {number}")
        return number, (None if value == str(number) else value)
    if isinstance(value, str) and value:
        return (current if partial and value == current_label else current + 1), value
    if isinstance(value, bool) or not isinstance(value, int):
        raise UpdateError(f"weight_version: must be an int or a non-empty string, got "
                          f"{value!r}")
    if value < 0:
        raise UpdateError(f"weight_version: must be >= 0 (a version counts weight changes), "
                          f"got {value}")
    return value, None


def read_json(path: Path) -> dict | None:
    """The JSON object in ``path`` (None when there is no such file); UpdateError naming the
    file when it is not one."""
    if not path.is_file():
        return None
    try:
        with open(path) as fh:
            out = json.load(fh)
    except (OSError, ValueError) as exc:
        raise UpdateError(f"{path.name}: must be a JSON object (fsdpfn's manifest), got "
                          f"{type(exc).__name__}: {exc} in {str(path)!r}") from None
    if not isinstance(out, dict):
        raise UpdateError(f"{path.name}: must be a JSON object, got {type(out).__name__} in "
                          f"{str(path)!r}")
    return out


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


def manifest_version(manifest: dict | None, path: Path) -> int | None:
    """The version fsdpfn's manifest names (None without a manifest); UpdateError when it
    names none."""
    if manifest is None:
        return None
    version = manifest.get("version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise UpdateError(f"{MANIFEST}: must name the files' version (an int >= 0), got "
                          f"{version!r} in {str(path)!r}")
    return version


def swap_bound(timeout_s: float) -> float:
    """How long a swap may wait for the model lock when its sender waits ``timeout_s`` for the
    answer: a little less, so that a swap the lock holds up is answered as a failure (previous
    weights kept) before the sender gives up, never done after the sender reported one."""
    return max(0.01, float(timeout_s) - min(2.0, 0.1 * float(timeout_s)))


def http_swap_s(payload: dict, start: float) -> float:
    """What is left of a request's swap bound: its sender's ``timeout_s`` (fsdpfn's senders
    send the timeout of their HTTP call; 300 s without one), less the time spent since
    ``start`` (time.monotonic())."""
    return max(0.01, swap_bound(request_timeout(payload)) - (time.monotonic() - start))


def request_fields(payload: dict) -> tuple[list[str], list[str], list[list[int]]]:
    """(names, dtypes, shapes) of an SGLang update request, typed as SGLang's pydantic types
    them (lists of strings, lists of lists of ints) and of equal lengths; else UpdateError."""
    fields = {key: payload.get(key) for key in ("names", "dtypes", "shapes")}
    for key in ("names", "dtypes"):
        value = fields[key]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise UpdateError(f"{key}: must be a list of strings, got {str(value)[:80]!r}")
    shapes = fields["shapes"]

    def dim(d):  # pydantic's lax int: an int, or a string of one
        if isinstance(d, str) and d.strip().isdecimal():
            return int(d)
        return d if isinstance(d, int) and not isinstance(d, bool) and d >= 0 else None

    if isinstance(shapes, list) and all(isinstance(s, list) for s in shapes):
        shapes = [[dim(d) for d in s] for s in shapes]
    if not isinstance(shapes, list) or not all(
            isinstance(s, list) and None not in s for s in shapes):
        raise UpdateError(f"shapes: must be a list of lists of ints >= 0, got "
                          f"{str(fields['shapes'])[:80]!r}")
    if not len(fields["names"]) == len(fields["dtypes"]) == len(shapes):
        raise UpdateError(f"names, dtypes, shapes: must have equal lengths, got "
                          f"{len(fields['names'])}, {len(fields['dtypes'])}, {len(shapes)}")
    return fields["names"], fields["dtypes"], shapes


def checked_checksum(tensors: dict, sums: list, finite: list) -> int:
    """The weights checksum of a whole update that arrived (``sums``: [(names, per-tensor
    checksums)], ``finite``: a flag a bucket), after its finite flags: one read of the device;
    an UpdateError naming the tensors when any is not finite."""
    flags = torch.stack(finite).to(torch.int64)
    names = [n for batch, _ in sums for n in batch]
    checksum = combine_on_device(torch.cat([v for _, v in sums]), names)
    values = torch.cat([flags, checksum.view(1)]).tolist()  # one read
    if not all(values[:len(flags)]):  # a bucket's sum is not finite: look closer
        bad = first_non_finite(tensors)
        if bad:
            raise UpdateError(f"update rejected, previous weights kept: tensors must be "
                              f"finite, got NaN/inf in {bad}")
    return values[-1]


def checksum_after(params: dict, aliases: dict, tensors: dict) -> int:
    """The weights checksum the served model will have once ``tensors`` are swapped in."""
    canonical = {aliases.get(n, n): t for n, t in tensors.items()}
    names = list(params)
    sums = tensor_checksums([canonical.get(n, params[n]) for n in names])
    return combine_checksums(dict(zip(names, sums)))


def load_update_files(payload: dict, params: dict, aliases: dict, device: torch.device,
                      version_of) -> tuple[dict, int, str | None]:
    """The tensors, version and label of /update_weights_from_disk's ``model_path``, loaded and
    checked (known names, shapes, dtypes, every parameter present; with fsdpfn's manifest and
    ``verify_checksums``: each tensor's sha256). ``version_of(value)`` reads a version as the
    receiver does; with a manifest the version is the manifest's (a label given beside it names
    that version)."""
    if not isinstance(payload.get("model_path"), str) or not payload["model_path"]:
        raise UpdateError(f"model_path: required, a directory of safetensors files, got "
                          f"{payload.get('model_path')!r}")
    path = Path(payload["model_path"])
    try:
        found = path.is_dir()
    except OSError as exc:  # a name past the file system's length (ENAMETOOLONG)
        raise UpdateError(f"model_path: must be a directory of safetensors files, got "
                          f"{str(path)[:200]!r} ({exc.strerror})") from None
    if not found:
        raise UpdateError(f"model_path: must be a directory of safetensors files, got "
                          f"{str(path)!r}", 404)
    manifest = read_json(path / MANIFEST)
    saved = manifest_version(manifest, path)
    given = payload.get("weight_version")
    version, label = version_of(given)
    if saved is not None and given is not None and label is None and saved != version:
        raise UpdateError(f"weight_version: must equal the manifest's version "
                          f"{saved} in {str(path)!r}, got {given!r}")
    if saved is not None:
        version = saved
    tensors = load_safetensors(path, device)
    problems = validate(params, aliases, list(tensors),
                        [t.dtype for t in tensors.values()],
                        [list(t.shape) for t in tensors.values()], whole=True)
    if manifest is not None and payload.get("verify_checksums", True):
        problems += check_manifest(manifest, tensors)
    if problems:
        raise UpdateError(f"update from {str(path)!r} rejected, previous weights kept: "
                          + "; ".join(problems[:8]))
    return tensors, version, label
