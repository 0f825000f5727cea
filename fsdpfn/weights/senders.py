"""The broadcast push to fsdpfn.rollout servers over HTTP, and what every broadcast push shares.

``send_flat`` drives one push: every rank gathers the buckets flat (gather_and_send), rank 0's
sender puts each on the wire, then concludes (checksums, versions) and every rank agrees on the
verdict; on any failure the sender abandons (the group is retired, generation resumed).

Rank 0's senders over HTTP (the update channel's is fsdpfn.weights.channel_sender, SGLang's is
fsdpfn.weights.sglang):
  - BroadcastSender: per bucket, the metadata to /update_weights_from_distributed in a thread
    (the call blocks in the server while it receives) and one async flat broadcast; the last
    bucket carries commit=true, generation paused around it.
  - OneRequestSender: the whole update in one request posted before the first bucket (servers
    that advertise multi_bucket), the broadcasts following with no HTTP round trip per bucket.
"""

from __future__ import annotations

import time
import uuid
from typing import Callable

import torch

from fsdpfn.agree import agree_on_error, capture_error
from fsdpfn.errors import WeightSyncError
from fsdpfn.state import EngineState
from fsdpfn.weights.gather import Bucket, gather_and_send
from fsdpfn.weights.servers import Servers, check_commit
from fsdpfn.wire.http import Call, call
from fsdpfn.wire.protocol import broadcast, combine_on_device, flat_checksums, wait_work

__all__ = ["PushTimings", "send_flat", "BroadcastSender", "OneRequestSender", "await_wire",
           "queue_checksum", "sent_checksum", "SentChecksums"]


class PushTimings:
    """This rank's seconds per phase of the last push (``seconds``: prepare, transfer,
    conclude, and the servers' own ``server_<phase>``); with ``timeline`` (benchmarks, CUDA),
    the last push over update channels leaves per-bucket GPU times in ``last_timeline``."""

    def __init__(self):
        self.start = time.perf_counter()
        self.seconds: dict[str, float] = {}
        self.timeline = False
        self.last_timeline: dict | None = None

    def begin(self) -> None:
        """A new push: the clock restarts, the phases of the last one are dropped."""
        self.start = time.perf_counter()
        self.seconds = {}

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def mark(self, phase: str) -> None:
        """``phase`` took place this many seconds into the push."""
        self.seconds[phase] = self.elapsed()

    def add_server_seconds(self, answers: dict[str, dict]) -> None:
        """The servers' own account of their seconds, summed as server_<phase>."""
        for answer in answers.values():
            for key, value in (answer.get("seconds") or {}).items():
                if isinstance(value, (int, float)):
                    self.seconds[f"server_{key}"] = self.seconds.get(f"server_{key}", 0.0) + value


def send_flat(state: EngineState, params, buckets: list[Bucket], sender, backend: str,
              timings: PushTimings) -> tuple[int, int]:
    """Collective: every bucket gathered flat and handed to rank 0's ``sender`` (None on the
    other ranks), then its conclusion agreed on; abandoned on any failure. Returns (n_tensors,
    n_bytes)."""
    out_device = state.mesh.device if backend == "nccl" else torch.device("cpu")
    try:
        clock = time.perf_counter()
        gather_and_send(state, dict(params), buckets, sender,
                        gather_device=state.mesh.device, out_device=out_device, flat=True)
        timings.seconds["transfer"] = time.perf_counter() - clock
        clock = time.perf_counter()
        error = None
        if sender is not None:
            _, error = capture_error(sender.conclude, "concluding the push")
        agree_on_error(state.mesh, error)
        timings.seconds["conclude"] = time.perf_counter() - clock
    except BaseException:
        if sender is not None:
            sender.abandon()
        raise
    return sum(len(b.specs) for b in buckets), sum(sum(b.sizes) for b in buckets)


class BroadcastSender:
    """Rank 0: metadata over HTTP (a thread per server) + one async flat broadcast per bucket."""

    def __init__(self, servers: Servers, timings: PushTimings, buckets: list[Bucket],
                 version: int):
        self.start_before_finish = servers.config.pipeline
        self.servers = servers
        self.timings = timings
        self.buckets = buckets
        self.version = version
        self.update_id = uuid.uuid4().hex
        self.checksums = SentChecksums()  # per bucket, on the device
        self.paused = False
        self.final_answers: dict[str, dict] = {}

    def start(self, bucket: Bucket, flat: torch.Tensor):
        s, cfg = self.servers, self.servers.config
        _, pg, backend = s.group.live
        last = bucket.index == len(self.buckets) - 1
        if last and cfg.pause_generation:
            self.paused = True
            s.pause()
        payload = {**bucket.metadata, "group_name": cfg.group_name,
                   "flush_cache": bool(last and cfg.flush_cache),
                   "load_format": "flattened_bucket", "weight_version": self.version,
                   "update_id": self.update_id, "bucket_index": bucket.index, "commit": last}
        calls = {url: Call(lambda url=url: call(url, "/update_weights_from_distributed", payload,
                                                timeout=cfg.timeout_s),
                           f"server {url}: /update_weights_from_distributed")
                 for url in s.urls}
        # ordered after the gather's copies on the current stream; the padded tail stays here
        work = broadcast(pg, flat[:bucket.nbytes])
        self.checksums.add(bucket, flat)
        if cfg.on_bucket is not None:
            cfg.on_bucket(bucket.index, len(self.buckets))
        return bucket, calls, work, flat, backend, time.monotonic() + cfg.timeout_s

    def finish(self, handle) -> None:
        bucket, calls, work, flat, backend, deadline = handle
        self.checksums.flush()
        wire_error = _wait(work, backend, deadline)
        if wire_error is not None:
            deadline = min(deadline, time.monotonic() + 2.0)  # the servers may explain
        errors, answers = [], {}
        for url, c in calls.items():
            try:
                answers[url] = c.result(deadline)
            except WeightSyncError as exc:
                errors.append(str(exc))
        where = where_in(self.servers, bucket, len(self.buckets))
        if errors:
            raise WeightSyncError("; ".join(errors) + f" {where}")
        if wire_error is not None:
            raise WeightSyncError(f"broadcast to {self.servers.urls} failed: {wire_error} "
                                  f"{where}")
        self.timings.add_server_seconds(answers)
        if bucket.index == len(self.buckets) - 1:
            self.final_answers = answers

    def conclude(self) -> None:
        """After the last bucket: checksums, continue generation, versions."""
        checksum = self.checksums.value()
        for url, answer in self.final_answers.items():
            check_commit(url, answer, self.version, checksum)
        if self.paused:
            self.paused = False
            self.servers.resume(strict=True)

    def abandon(self) -> None:
        """After a failure: the group may be out of step (drop it); never leave generation
        paused."""
        self.servers.retire()
        if self.paused:
            self.paused = False
            self.servers.resume(strict=False)


class OneRequestSender:
    """Rank 0, for servers that take a whole update in one request (fsdpfn.rollout advertises
    multi_bucket): one HTTP request carries every bucket's metadata and is posted before the
    first bucket is gathered; the server posts every receive, the broadcasts follow with two
    buckets in flight, and the answer (after the server's commit, generation paused around the
    swap when asked) is read at the end. No HTTP round trip per bucket."""

    start_before_finish = True

    def __init__(self, servers: Servers, timings: PushTimings, buckets: list[Bucket],
                 version: int):
        self.servers = servers
        self.timings = timings
        self.buckets = buckets
        self.version = version
        self.checksums = SentChecksums()
        cfg = servers.config
        payload = {"buckets": [b.metadata for b in buckets], "group_name": cfg.group_name,
                   "flush_cache": cfg.flush_cache, "load_format": "flattened_bucket",
                   "weight_version": version, "update_id": uuid.uuid4().hex,
                   "pause_generation": cfg.pause_generation, "commit": True}
        self.calls = {url: Call(lambda url=url: call(url, "/update_weights_from_distributed",
                                                     payload, timeout=cfg.timeout_s
                                                     * max(1, len(buckets))),
                                f"server {url}: /update_weights_from_distributed")
                      for url in servers.urls}

    def _server_error(self) -> str | None:
        for c in self.calls.values():
            if c.done():
                try:
                    c.result(time.monotonic())
                except WeightSyncError as exc:
                    return str(exc)
        return None

    def start(self, bucket: Bucket, flat: torch.Tensor):
        cfg = self.servers.config
        _, pg, backend = self.servers.group.live
        work = broadcast(pg, flat[:bucket.nbytes])  # before the checksum: not held up by it
        self.checksums.add(bucket, flat)
        if cfg.on_bucket is not None:
            cfg.on_bucket(bucket.index, len(self.buckets))
        return bucket, work, flat, time.monotonic() + cfg.timeout_s

    def _watch(self, wait_s: float) -> None:
        """A server that failed answers before the wire completes: raise its error."""
        error = self._server_error()
        if error is not None:
            raise WeightSyncError(error)
        time.sleep(wait_s)

    def finish(self, handle) -> None:
        bucket, work, flat, deadline = handle
        self.checksums.flush()
        await_wire(work, deadline, self.servers, bucket, len(self.buckets), self._watch)

    def conclude(self) -> None:
        checksum = self.checksums.value()
        deadline = time.monotonic() + self.servers.config.timeout_s
        errors, answers = [], {}
        for url, c in self.calls.items():
            try:
                answers[url] = c.result(deadline)
            except WeightSyncError as exc:
                errors.append(str(exc))
        if errors:
            raise WeightSyncError("; ".join(errors))
        self.timings.add_server_seconds(answers)
        for url, answer in answers.items():
            check_commit(url, answer, self.version, checksum)

    def abandon(self) -> None:
        self.servers.retire()


# ---------------------------------------------------------------- shared by the senders


def await_wire(work, deadline: float, servers: Servers, bucket: Bucket, n_buckets: int,
               watch: Callable[[float], None]) -> None:
    """Wait for a bucket's broadcast, calling watch(seconds) between polls (it raises
    WeightSyncError when a server failed meanwhile); every failure is a WeightSyncError naming
    the bucket."""
    where = where_in(servers, bucket, n_buckets)
    try:
        while not work.is_completed():
            watch(0.0002)
            if time.monotonic() > deadline:
                raise WeightSyncError(f"broadcast to {servers.urls} did not complete within "
                                      f"timeout_s")
        work.wait()
    except WeightSyncError as exc:
        raise WeightSyncError(f"{exc} {where}") from None
    except Exception as exc:  # noqa: BLE001 - gloo raises RuntimeError
        raise WeightSyncError(f"broadcast to {servers.urls} failed: {type(exc).__name__}: "
                              f"{exc} {where}") from None


def where_in(servers: Servers, bucket: Bucket, n_buckets: int) -> str:
    """The bucket a failure happened in, for its message."""
    return (f"[bucket {bucket.index} of {n_buckets}, {len(bucket.specs)} tensors from "
            f"{bucket.names[0]!r}, {bucket.nbytes} bytes; "
            f"timeout_s={servers.config.timeout_s:g}]")


def queue_checksum(checksums: list, bucket: Bucket, flat: torch.Tensor) -> None:
    """Queue the checksums of a bucket on the device, after its broadcast (they read the buffer
    while the wire does); read once, by sent_checksum: no synchronisation per bucket."""
    checksums.append((bucket.names, flat_checksums(flat, bucket.offsets, bucket.sizes)))


class SentChecksums:
    """The checksums of the buckets sent, queued on the device one bucket late: a bucket's are
    queued once the next bucket has gone out (or at a finish, or at the end), so the host
    launches the next bucket's gather before paying the checksum's few dozen kernel launches
    (about a millisecond a bucket, with the wire idle meanwhile). The late bucket's buffer is
    held until then; its kernels read it in stream order, after the next gather."""

    def __init__(self):
        self._queued: list[tuple[list[str], torch.Tensor]] = []
        self._late: tuple[Bucket, torch.Tensor] | None = None

    def add(self, bucket: Bucket, flat: torch.Tensor) -> None:
        self.flush()
        self._late = (bucket, flat)

    def flush(self) -> None:
        if self._late is not None:
            queue_checksum(self._queued, *self._late)
            self._late = None

    def value(self) -> int:
        """The weights checksum of every bucket added (one synchronisation)."""
        self.flush()
        return sent_checksum(self._queued)


def sent_checksum(checksums: list) -> int:
    """The weights checksum of everything sent (one synchronisation)."""
    names = [n for batch, _ in checksums for n in batch]
    return int(combine_on_device(torch.cat([v for _, v in checksums]), names))


def _wait(work, backend: str, deadline: float) -> str | None:
    """Wait for a broadcast until ``deadline``; the error text, or None when it completed."""
    try:
        wait_work(work, backend, deadline - time.monotonic())
        return None
    except Exception as exc:  # noqa: BLE001 - gloo raises RuntimeError, NCCL TimeoutError
        return f"{type(exc).__name__}: {exc}"
