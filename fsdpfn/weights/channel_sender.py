"""Rank 0's push over the update channels of fsdpfn.rollout servers (fsdpfn.weights.channel).

The update message goes out before the first bucket is gathered (its bucket layout only the first
time a server sees that layout, then its id); each server checks it and answers "accepted" before
any byte is broadcast, so a refused update never leaves a server waiting for bytes; the
broadcasts follow without waiting for each other (gather_and_send's memory bound); each server
answers once more after its commit. While waiting on the wire the channels are watched: a
server's failure or exit is seen at once, not at the timeout.
"""

from __future__ import annotations

import time
import uuid

import torch

from fsdpfn.errors import WeightSyncError
from fsdpfn.weights.channel import wait_readable
from fsdpfn.weights.gather import Bucket
from fsdpfn.weights.senders import PushTimings, SentChecksums, await_wire
from fsdpfn.weights.servers import Servers, check_commit
from fsdpfn.wire.protocol import broadcast

__all__ = ["ChannelSender"]


class ChannelSender:
    """Rank 0's side of gather_and_send() over update channels (see the module doc)."""

    start_before_finish = True

    def __init__(self, servers: Servers, timings: PushTimings, buckets: list[Bucket],
                 version: int, layout_id: int):
        self.servers = servers
        self.timings = timings
        self.buckets = buckets
        self.version = version
        self.checksums = SentChecksums()
        self.channels = {url: servers.channels[url] for url in servers.urls}
        self.answers: dict[str, dict] = {}
        self.accepted = False
        # with timings.timeline (benchmarks, CUDA): GPU and host times of each bucket, both ends
        self.timeline = {"t0_ms": timings.elapsed() * 1e3, "events": [_timing_event()],
                         "launch_ms": []} \
            if timings.timeline and torch.cuda.is_available() else None
        self._send_update(layout_id)

    def _send_update(self, layout_id: int) -> None:
        cfg = self.servers.config
        message = {"op": "update", "layout_id": layout_id, "group_name": cfg.group_name,
                   "weight_version": self.version, "update_id": uuid.uuid4().hex,
                   "pause_generation": cfg.pause_generation,
                   "flush_cache": cfg.flush_cache, "load_format": "flattened_bucket",
                   "timeline": self.timeline is not None}
        metadata = None
        for ch in self.channels.values():
            if layout_id not in ch.layouts:
                metadata = metadata or [b.metadata for b in self.buckets]
                ch.send({**message, "buckets": metadata})
                ch.layouts.add(layout_id)
            else:
                ch.send(message)

    def _await_accepted(self) -> None:
        deadline = time.monotonic() + self.servers.config.timeout_s
        for url, ch in self.channels.items():
            answer = ch.read(deadline, "the update")
            if not answer.get("accepted"):
                raise WeightSyncError(f"server {url}: the update channel must answer "
                                      f"'accepted' first, got {str(answer)[:200]}")
        self.accepted = True
        self.timings.mark("accepted")

    def start(self, bucket: Bucket, flat: torch.Tensor):
        cfg = self.servers.config
        if not self.accepted:
            self._await_accepted()
        _, pg, _ = self.servers.group.live
        if self.timeline is not None:
            self.timeline["launch_ms"].append(self.timings.elapsed() * 1e3)
            gathered = _timing_event()
        work = broadcast(pg, flat[:bucket.nbytes])  # before the checksum: not held up by it
        if self.timeline is not None:
            self._record_sent(work, gathered)
        self.checksums.add(bucket, flat)  # queued when the next bucket is out
        if bucket.index == 0:
            self.timings.mark("first_send")
        if cfg.on_bucket is not None:
            cfg.on_bucket(bucket.index, len(self.buckets))
        return bucket, work, time.monotonic() + cfg.timeout_s

    def _record_sent(self, work, gathered) -> None:
        """An event on a side stream once the broadcast is done (the timeline's sent time)."""
        if "stream" not in self.timeline:
            self.timeline["stream"] = torch.cuda.Stream()
        side = self.timeline["stream"]
        with torch.cuda.stream(side):
            work.wait()
            self.timeline["events"].append((gathered, _timing_event(side)))

    def _watch(self, wait_s: float) -> None:
        """Read whatever a server sent meanwhile (its final answer, or its failure: raised)."""
        waiting = [ch.sock for url, ch in self.channels.items() if url not in self.answers]
        if not waiting:
            time.sleep(wait_s)
            return
        ready = wait_readable(waiting, wait_s)
        for url, ch in self.channels.items():
            if ch.sock in ready:
                self.answers[url] = ch.read(time.monotonic() + self.servers.config.timeout_s,
                                            "the update")

    def finish(self, handle) -> None:
        bucket, work, deadline = handle
        self.checksums.flush()  # the buffer may be released once this returns
        await_wire(work, deadline, self.servers, bucket, len(self.buckets), self._watch)

    def conclude(self) -> None:
        checksum = self.checksums.value()
        deadline = time.monotonic() + self.servers.config.timeout_s
        for url, ch in self.channels.items():
            if url not in self.answers:
                self.answers[url] = ch.read(deadline, "the update")
        self.timings.add_server_seconds(self.answers)
        for url, answer in self.answers.items():
            check_commit(url, answer, self.version, checksum)
        if self.timeline is not None:
            self.timings.last_timeline = self._timeline()

    def _timeline(self) -> dict:
        t0, *pairs = self.timeline["events"]
        return {"t0_ms": self.timeline["t0_ms"], "launch_ms": self.timeline["launch_ms"],
                "gathered_ms": [t0.elapsed_time(g) for g, _ in pairs],
                "sent_ms": [t0.elapsed_time(e) for _, e in pairs],
                "bucket_bytes": [b.nbytes for b in self.buckets],
                "servers": {url: a.get("timeline") for url, a in self.answers.items()}}

    def abandon(self) -> None:
        self.servers.retire()


def _timing_event(stream=None):
    event = torch.cuda.Event(enable_timing=True)
    event.record(stream)
    return event
