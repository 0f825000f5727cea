"""The server's weight updates, composed from the stages of fsdpfn.rollout.staging: every path
(a whole update over HTTP or the update channel, per-bucket HTTP, disk, CUDA IPC) ends in a
verified swap under the model lock, and any failure leaves the served weights and version as
they were.

Per-bucket checks (finite values, per-tensor checksums) are queued on the device as each bucket
arrives and read once, at commit. A whole update (one request, or the update channel) takes the
model lock once its receives are posted and re-points the parameters while the bytes arrive
(nothing reads them meanwhile); a failed check points them back before the lock is released.

Buckets of one update may be posted before the previous one is done (a trainer overlaps the
HTTP round trip with the transfer): a request waits, up to its group's timeout, for its turn.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from fsdpfn.rollout import lora as rollout_lora
from fsdpfn.rollout.errors import UpdateError
from fsdpfn.rollout.groups import exclusive, fail_update, require_group, retire_group, wait_turn
from fsdpfn.rollout.staging import (MANIFEST, Layout, Staging, check_manifest, check_stream,
                                    events_done, load_safetensors, post_flat, read_json,
                                    receive, record_event, staging_for, swap_back, swap_in,
                                    torch_dtypes, unpack_flat, validate, version_of, wait_events)
from fsdpfn.wire.protocol import combine_checksums, combine_on_device, wait_work

__all__ = ["update_from_distributed", "update_from_ipc", "update_from_disk", "commit",
           "load_lora_adapter", "unload_lora_adapter"]


def update_from_distributed(engine, payload: dict, *, layout: "Layout | None" = None,
                            ack=None) -> dict:
    """/update_weights_from_distributed: {names, dtypes, shapes, group_name, flush_cache,
    load_format ("flattened_bucket": one uint8 broadcast; else one broadcast per tensor),
    weight_version, update_id, bucket_index, commit}. Without update_id the call is a
    self-contained (possibly partial) update, as in SGLang. With ``buckets`` (a list of
    {names, dtypes, shapes}; advertised as multi_bucket in /get_model_info) the whole update
    is one request (see _update_buckets; the update channel passes its parsed ``layout``
    and an ``ack()`` to call once the update is accepted, before any byte is sent)."""
    update_id = payload.get("update_id")
    try:
        index = int(payload.get("bucket_index") or 0)
    except (TypeError, ValueError):
        index = 0
    group = engine._groups.get(str(payload.get("group_name")))
    wait_s = float(group[3]) if group is not None else 0.0
    clock = time.perf_counter()
    wait_turn(engine, update_id, index, wait_s)
    waited = time.perf_counter() - clock
    try:
        if update_id is not None and update_id in engine._failed:
            # an earlier bucket failed: the sender has dropped the group, nothing will come
            retire_group(engine, str(payload.get("group_name")))
            raise UpdateError(f"bucket_index {index}: update {update_id!r} already failed "
                              f"({engine.last_error}); group dropped, previous weights kept",
                              409)
        answer = (_update_buckets(engine, payload, layout, ack) if layout is not None
                  else _update_from_distributed(engine, payload))
        answer["seconds"] = {"wait_turn": waited, **answer.get("seconds", {}),
                             "total": time.perf_counter() - clock}
        return answer
    except UpdateError as exc:
        if update_id is not None:
            if len(engine._failed) > 1000:
                engine._failed.clear()
            engine._failed.add(update_id)
        fail_update(engine, exc)
        raise
    finally:
        with engine._turn:
            engine._busy = False
            engine._turn.notify_all()


def _update_from_distributed(engine, payload: dict) -> dict:
    if payload.get("buckets") is not None:
        try:
            layout = Layout(engine, payload["buckets"])
        except UpdateError as exc:
            if getattr(exc, "unsized", False):  # the group is out of step: drop it
                retire_group(engine, str(payload.get("group_name")))
                raise UpdateError(f"{exc}; group {payload.get('group_name')!r} dropped, "
                                  f"re-initialise it") from None
            raise
        return _update_buckets(engine, payload, layout, None)
    try:
        names = [str(n) for n in payload["names"]]
        dtypes = [str(d) for d in payload["dtypes"]]
        shapes = [[int(d) for d in s] for s in payload["shapes"]]
        group_name = str(payload["group_name"])
    except (KeyError, TypeError, ValueError) as exc:
        raise UpdateError(f"update_weights_from_distributed: payload must hold names, "
                          f"dtypes, shapes, group_name; got {sorted(payload)} "
                          f"({type(exc).__name__}: {exc})") from None
    if not (len(names) == len(dtypes) == len(shapes)):
        raise UpdateError(f"names, dtypes, shapes: must have equal lengths, got "
                          f"{len(names)}, {len(dtypes)}, {len(shapes)}")
    require_group(engine, group_name)
    flat = payload.get("load_format") == "flattened_bucket"
    typed = torch_dtypes(engine, dtypes, group_name)
    update_id = payload.get("update_id")
    staging = staging_for(engine, update_id, int(payload.get("bucket_index") or 0))
    problems = validate(engine, names, typed, shapes, staging)
    clock = time.perf_counter()
    received, sums, finite = receive(engine, group_name, flat, dtypes, typed, shapes)
    seconds = {"receive": time.perf_counter() - clock}
    if problems:
        raise UpdateError("update rejected, previous weights kept: " + "; ".join(problems))
    staging.tensors.update(zip(names, received))
    staging.sums.append(([engine.aliases.get(n, n) for n in names], sums))
    staging.finite.append(finite)
    staging.next_bucket += 1
    last = bool(payload.get("commit", update_id is None))
    if not last:
        return {"success": True, "weight_version": engine.version, "staged":
                len(staging.tensors), "message": f"staged {len(names)} tensors",
                "seconds": seconds}
    version = version_of(payload, engine.version + 1)
    clock = time.perf_counter()
    answer = commit(engine, staging, version,
                          partial=update_id is None)
    seconds["commit"] = time.perf_counter() - clock
    return {**answer, "seconds": seconds}


def _update_buckets(engine, payload: dict, layout: Layout, ack) -> dict:
    """The whole update in one request: {buckets: [{names, dtypes, shapes}, ...],
    group_name, weight_version, update_id, pause_generation, load_format="flattened_bucket"}
    (over the update channel, ``layout`` is that list already parsed).

    Every bucket's receive is posted at once (the sender keeps several in flight). Over NCCL
    the host never waits per bucket: a side stream waits for each bucket's bytes and runs its
    checks (zero padding, per-tensor checksums, finite), and meanwhile the host takes the
    model lock (no generation or forward runs until the end) and points every parameter at
    its received tensor. Then the host waits for the checks, reads them once, and either
    keeps the new weights (the version moves) or points every parameter back (nothing
    changed). With ``ack`` (the update channel), a layout that cannot be committed is refused
    before any byte is sent, and ack() is called once it is accepted; without it (HTTP), the
    bytes are received and then refused, which keeps the group in step."""
    clock = time.perf_counter()
    group_name = str(payload.get("group_name"))
    require_group(engine, group_name)
    if layout.problems and ack is not None:
        raise UpdateError("update refused before any byte was sent, previous weights kept: "
                          + "; ".join(layout.problems))
    version = version_of(payload, engine.version + 1)
    if ack is not None:
        ack()
    store, pg, backend, timeout_s = engine._groups[group_name]
    nccl = backend == "nccl"
    seconds = {}
    staging = Staging(payload.get("update_id"))
    posted, done = [], []
    timeline = [] if nccl and payload.get("timeline") else None  # GPU times, for benchmarks
    try:
        device = engine.device if nccl else torch.device("cpu")
        stream = check_stream(engine) if nccl else None
        if timeline is not None:
            timeline.append(record_event(stream, True))
        posted = [post_flat(pg, device, b.total) for b in layout.buckets]
        seconds["post"] = time.perf_counter() - clock
        for b, names, (buf, work) in zip(layout.buckets, layout.canonical, posted):
            if nccl:
                with torch.cuda.stream(stream):
                    work.wait()  # the side stream waits for the bytes; the host does not
                    if timeline is not None:
                        timeline.append(record_event(stream, True))
                    out, sums, finite = unpack_flat(buf, b)
                done.append(record_event(stream, timeline is not None))
            else:
                wait_work(work, backend, timeout_s)
                out, sums, finite = unpack_flat(buf.to(engine.device), b)
            staging.tensors.update(zip(names, out))
            staging.sums.append((names, sums))
            staging.finite.append(finite)
        seconds["queue"] = time.perf_counter() - clock
        if layout.problems:  # HTTP: every byte taken, then refused
            wait_events(done, timeout_s)
            raise UpdateError("update rejected, previous weights kept: "
                              + "; ".join(layout.problems))
        if not engine._model_lock.acquire(timeout=timeout_s):
            raise UpdateError(f"update: a generation held the model for longer than the "
                              f"group's timeout_s {timeout_s:g}; previous weights kept", 503)
    except UpdateError:
        wait_events(done, timeout_s, quiet=True)
        raise
    except Exception as exc:  # noqa: BLE001 - a dead or stalled sender
        retire_group(engine, group_name)
        engine._retired.append(posted)  # buffers may still be written: keep them alive
        raise UpdateError(f"receiving over group {group_name!r} failed: "
                          f"{type(exc).__name__}: {exc}; group dropped, previous weights "
                          f"kept", 500) from None
    previous: dict[str, torch.Tensor] = {}
    locked = True
    try:
        swap_in(engine, staging.tensors, previous)  # nothing runs on the model meanwhile
        seconds["swap"] = time.perf_counter() - clock
        try:
            if not events_done(done, time.monotonic() + engine.hold_s):
                # a slow (or dead) sender: give the model back to generation while the
                # bytes come, and take it again for the swap
                swap_back(engine, previous)
                engine._model_lock.release()
                locked = False
                wait_events(done, timeout_s)
                if not engine._model_lock.acquire(timeout=timeout_s):
                    raise UpdateError(f"update: a generation held the model for longer "
                                      f"than the group's timeout_s {timeout_s:g}; previous "
                                      f"weights kept", 503)
                locked = True
                swap_in(engine, staging.tensors, previous)
        except UpdateError:
            raise
        except Exception as exc:  # noqa: BLE001 - the bytes did not come
            retire_group(engine, group_name)
            engine._retired.append(posted)
            raise UpdateError(f"receiving over group {group_name!r} failed: "
                              f"{type(exc).__name__}: {exc}; group dropped, previous "
                              f"weights kept", 500) from None
        seconds["wait"] = time.perf_counter() - clock
        flags = torch.stack(staging.finite).to(torch.int64)
        names = [n for batch, _ in staging.sums for n in batch]
        checksum = combine_on_device(torch.cat([v for _, v in staging.sums]), names)
        values = torch.cat([flags, checksum.view(1)]).tolist()  # one read
        if not all(values[:len(flags)]):  # a bucket's sum is not finite: look closer
            bad = [n for n, t in staging.tensors.items() if not bool(torch.isfinite(t).all())]
            if bad:
                raise UpdateError(f"update rejected, previous weights kept: tensors must be "
                                  f"finite, got NaN/inf in {bad[:3]}")
        engine.version = version
    except BaseException:
        swap_back(engine, previous)
        raise
    finally:
        if locked:
            engine._model_lock.release()
    checksum = values[-1]
    engine._staging = None
    engine.last_error = None
    seconds["commit"] = time.perf_counter() - clock
    answer = {"success": True, "weight_version": version, "weights_checksum": checksum,
              "message": f"updated {len(staging.tensors)} tensors to version {version}",
              "seconds": seconds}
    if timeline is not None:  # ms from posting the receives: each bucket in, then checked
        answer["timeline"] = {
            "arrived_ms": [timeline[0].elapsed_time(e) for e in timeline[1:]],
            "checked_ms": [timeline[0].elapsed_time(e) for e in done]}
    return answer


def commit(engine, staging: Staging, version: int, *, partial: bool) -> dict:
    """Validate the whole staging, then swap it in under the model lock (no copy: each
    parameter is pointed at its received tensor)."""
    tensors = {engine.aliases.get(n, n): t for n, t in staging.tensors.items()}
    if not partial:
        missing = [n for n in engine.params if n not in tensors]
        if missing:
            raise UpdateError(f"update rejected, previous weights kept: every parameter of "
                              f"the served model must be sent, got none for {len(missing)} "
                              f"(e.g. {missing[:3]})")
    if not staging.finite:  # from disk: checked here
        staging.finite = [torch.isfinite(t).all() for t in tensors.values()]
    if not bool(torch.stack([f.to(engine.device) for f in staging.finite]).all()):
        bad = [n for n, t in tensors.items() if not bool(torch.isfinite(t).all())]
        raise UpdateError(f"update rejected, previous weights kept: tensors must be finite, "
                          f"got NaN/inf in {bad[:3]}")
    with engine._model_lock:
        swap_in(engine, tensors, {})
        engine.version = version
        if not partial:
            rollout_lora.forget(engine)
    if partial or not staging.sums:
        checksum = engine.weights_checksum()
    else:
        names = [n for batch, _ in staging.sums for n in batch]
        values = torch.cat([v.to(engine.device) for _, v in staging.sums]).tolist()
        checksum = combine_checksums(dict(zip(names, values)))
    engine._staging = None
    engine.last_error = None
    return {"success": True, "weight_version": version, "weights_checksum": checksum,
            "message": f"updated {len(tensors)} tensors to version {version}"}


def _alone(engine, fn, payload: dict) -> dict:
    """``fn(engine, payload)`` with no other update running; a refusal is recorded (and
    generation resumed) before it is raised."""
    with exclusive(engine, 0.0):
        try:
            return fn(engine, payload)
        except UpdateError as exc:
            fail_update(engine, exc)
            raise


def update_from_ipc(engine, payload: dict) -> dict:
    """/update_weights_from_ipc: {buckets: [{names, dtypes, shapes, handle}], weight_version,
    flush_cache}: each bucket's tensors packed back to back in a device buffer of a process
    on this GPU, named by its CUDA IPC handle (fsdpfn.wire.ipc); copied out here, checked
    and committed like a whole update. The sender frees the buffers after the answer."""
    return _alone(engine, _update_from_ipc, payload)


def _update_from_ipc(engine, payload: dict) -> dict:
    from fsdpfn.wire.ipc import open_shared, unpack

    if engine.device.type != "cuda":
        raise UpdateError(f"update_weights_from_ipc: needs a server on a GPU, and this one "
                          f"runs on {engine.device}")
    version = version_of(payload, None)
    if version is None:
        raise UpdateError("weight_version: must be an int (or a string of one), got None")
    layout = Layout(engine, payload.get("buckets"))
    if layout.problems:
        raise UpdateError("update rejected, previous weights kept: "
                          + "; ".join(layout.problems[:8]))
    staging = Staging(None)
    for spec, b in zip(payload["buckets"], layout.buckets):
        try:
            buffer = open_shared(spec.get("handle") or {}, engine.device)
            tensors = unpack(buffer, b.torch_dtypes, b.shapes)
        except (ValueError, RuntimeError) as exc:
            raise UpdateError(f"update rejected, previous weights kept: {exc}") from None
        del buffer
        staging.tensors.update(zip(b.names, tensors))
    torch.cuda.synchronize(engine.device)  # every copy done before the sender frees its buffers
    return commit(engine, staging, version, partial=False)


def load_lora_adapter(engine, payload: dict) -> dict:
    """/load_lora_adapter (SGLang's payload): see fsdpfn.rollout.lora."""
    return _alone(engine, rollout_lora.load_adapter, payload)


def unload_lora_adapter(engine, payload: dict) -> dict:
    """/unload_lora_adapter (SGLang's payload): see fsdpfn.rollout.lora."""
    with exclusive(engine, 0.0):
        return rollout_lora.unload_adapter(engine, payload)


def update_from_disk(engine, payload: dict) -> dict:
    """/update_weights_from_disk: {model_path, weight_version, flush_cache, load_format,
    verify_checksums (default true: sha256 of each tensor against fsdpfn_manifest.json)}."""
    return _alone(engine, _update_from_disk, payload)


def _update_from_disk(engine, payload: dict) -> dict:
    path = Path(str(payload.get("model_path") or ""))
    if not path.is_dir():
        raise UpdateError(f"model_path: must be a directory of safetensors files, got "
                          f"{str(path)!r}", 404)
    manifest = read_json(path / MANIFEST)
    version = version_of(payload, None)
    if manifest is not None and version is not None and \
            int(manifest["version"]) != version:
        raise UpdateError(f"weight_version: must equal the manifest's version "
                          f"{manifest['version']} in {str(path)!r}, got {version}")
    if version is None:
        version = manifest["version"] if manifest is not None else engine.version + 1
    staging = Staging(None)
    tensors = load_safetensors(path, engine.device)
    problems = validate(engine, list(tensors), [t.dtype for t in tensors.values()],
                              [list(t.shape) for t in tensors.values()], staging)
    if manifest is not None and payload.get("verify_checksums", True):
        problems += check_manifest(manifest, tensors)
    if problems:
        raise UpdateError(f"update from {str(path)!r} rejected, previous weights kept: "
                          + "; ".join(problems[:8]))
    staging.tensors = tensors
    return commit(engine, staging, int(version), partial=False)
