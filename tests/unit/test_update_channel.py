"""The update channel (fsdpfn.rollout.receiver, fsdpfn.weights.channel, fsdpfn.wire.frames)
against a real RolloutEngine in this process: member 0 of a real gloo group is this test, the engine member 1.

What it must show: an update is accepted before any byte moves and lands exactly (checksum of
what was sent, the served parameters equal, the version moves) only once the trainer commits
it after the server's "ready": a trainer that never commits (it failed after the last byte, or
the checksum differed) leaves the previous weights and version; a layout is sent once per
connection and then named by id; an update the server cannot take is refused before any byte
is sent, and the group stays in step (the next update lands); a NaN is refused after the bytes,
with the previous weights kept bit for bit; dropping the group closes the channel (the
trainer's cheap sign that it must set up again); bad frames and unknown groups get typed
answers.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from fsdpfn.errors import WeightSyncError
from fsdpfn.rollout import RolloutEngine
from fsdpfn.rollout.channel import UpdateChannel
from fsdpfn.rollout.process import free_port
from fsdpfn.testing import save_tiny_model, tiny_qwen2_config
from fsdpfn.weights.channel import Channel
from fsdpfn.wire.frames import recv_frame, send_frame
from fsdpfn.wire.protocol import (broadcast, bucket_layout, combine_checksums, make_group,
                                  tensor_checksum)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("m") / "tiny", tiny_qwen2_config(), seed=0)


@pytest.fixture()
def served(model_dir):
    """(engine, its update channel, member 0's process group, group name)."""
    engine = RolloutEngine(str(model_dir), dtype="float32", device="cpu", max_pause_s=30)
    channel = UpdateChannel(engine.receiver)
    port, name = free_port(), "g-channel"
    answer = {}
    t = threading.Thread(target=lambda: answer.update(engine.receiver.init_group({
        "master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
        "world_size": 2, "group_name": name, "backend": "gloo", "timeout_s": 20})))
    t.start()
    store, pg = make_group(master_address="127.0.0.1", master_port=port, rank=0, world_size=2,
                           group_name=name, backend="gloo", timeout_s=20)
    t.join(30)
    assert answer.get("success"), answer
    yield engine, channel, pg, name
    channel.close()


def _new_weights(engine, seed):
    g = torch.Generator().manual_seed(seed)
    return {n: (p.detach() + 0.01 * torch.randn(p.shape, generator=g)).clone()
            for n, p in engine.params.items()}


def _metadata(buckets):
    return [{"names": list(b), "dtypes": [str(t.dtype).removeprefix("torch.") for t in b.values()],
             "shapes": [list(t.shape) for t in b.values()]} for b in buckets]


def _send_bytes(pg, buckets):
    """One flat broadcast per bucket, garbage between the tensors (it must not count)."""
    for bucket, meta in zip(buckets, _metadata(buckets)):
        offsets, total = bucket_layout(meta["dtypes"], meta["shapes"])
        buf = torch.full((total,), 0xCD, dtype=torch.uint8)
        for o, t in zip(offsets, bucket.values()):
            buf[o:o + t.numel() * t.element_size()].view(t.dtype).copy_(t.flatten())
        broadcast(pg, buf).wait()


def _update(ch: Channel, name, version, layout_id, buckets=None):
    message = {"op": "update", "layout_id": layout_id, "group_name": name,
               "weight_version": version}
    if buckets is not None:
        message["buckets"] = _metadata(buckets)
    ch.send(message)


def _commit(ch: Channel, version: int, sent: int | None = None) -> dict:
    """The server's "ready" (nothing swapped yet), then the commit and its final answer."""
    ready = ch.read(time.monotonic() + 20, "update")
    assert ready["ready"] is True and ready["weight_version"] == version, ready
    if sent is not None:
        assert ready["weights_checksum"] == sent
    ch.send({"op": "commit"})
    return ch.read(time.monotonic() + 20, "commit")


def _split(weights):
    names = list(weights)
    return [{n: weights[n] for n in names[:4]}, {n: weights[n] for n in names[4:]}]


@pytest.mark.timeout(90)
def test_update_lands_and_layout_is_sent_once(served):
    engine, channel, pg, name = served
    assert engine.info()["update_channel"] == channel.port
    ch = Channel("http://test", "127.0.0.1", channel.port, name, timeout_s=10)
    assert ch.server_id == engine.server_id and not ch.stale()
    for version, layout_buckets, seed in ((3, True, 1), (4, False, 2)):
        new = _new_weights(engine, seed)
        buckets = _split(new)
        _update(ch, name, version, 0, buckets if layout_buckets else None)
        assert ch.read(time.monotonic() + 10, "update")["accepted"] is True
        _send_bytes(pg, buckets)
        sent = combine_checksums({n: tensor_checksum(t) for n, t in new.items()})
        answer = _commit(ch, version, sent)
        assert answer["weight_version"] == version == engine.version
        assert answer["weights_checksum"] == sent == engine.weights_checksum()
        assert all(torch.equal(p, new[n]) for n, p in engine.params.items())
    ch.close()


@pytest.mark.timeout(90)
def test_refusals_keep_the_weights_and_the_group_in_step(served):
    engine, channel, pg, name = served
    ch = Channel("http://test", "127.0.0.1", channel.port, name, timeout_s=10)
    kept = {n: p.detach().clone() for n, p in engine.params.items()}
    version = engine.version

    # an unknown layout id, then an unknown name: refused before any byte is sent
    _update(ch, name, 5, 7)
    with pytest.raises(WeightSyncError, match="layout_id: must name a layout"):
        ch.read(time.monotonic() + 10, "update")
    bad = _new_weights(engine, 3)
    bad["model.not_a_weight"] = torch.zeros(3)
    _update(ch, name, 5, 1, [bad])
    with pytest.raises(WeightSyncError, match="answered 400: update refused before any byte "
                                              "was sent.*name must be a parameter"):
        ch.read(time.monotonic() + 10, "update")

    # a NaN: accepted, every byte received, then refused; the weights stay bit for bit
    nan = _new_weights(engine, 4)
    last = list(nan)[-1]
    nan[last].view(-1)[0] = float("nan")
    _update(ch, name, 6, 2, _split(nan))
    assert ch.read(time.monotonic() + 10, "update")["accepted"]
    _send_bytes(pg, _split(nan))
    with pytest.raises(WeightSyncError, match=f"must be finite, got NaN/inf in .*{last}"):
        ch.read(time.monotonic() + 20, "update")
    assert engine.version == version
    assert all(torch.equal(p, kept[n]) for n, p in engine.params.items())

    # the group is still in step: the next update lands
    good = _new_weights(engine, 5)
    _update(ch, name, 7, 3, _split(good))
    assert ch.read(time.monotonic() + 10, "update")["accepted"]
    _send_bytes(pg, _split(good))
    assert _commit(ch, 7)["weight_version"] == 7 == engine.version
    ch.close()


@pytest.mark.timeout(90)
def test_an_update_the_trainer_does_not_commit_keeps_the_previous_weights(served):
    """Every byte arrived and checked ("ready"), then the trainer fails instead of committing:
    its channel closes (or it answers anything but "commit"). The server keeps the weights and
    version it served, and the next update, on a new channel, lands."""
    engine, channel, pg, name = served
    kept = {n: p.detach().clone() for n, p in engine.params.items()}
    version = engine.version
    for ending in ("close", "abort"):
        ch = Channel("http://test", "127.0.0.1", channel.port, name, timeout_s=10)
        new = _split(_new_weights(engine, 6))
        _update(ch, name, version + 1, 0, new)
        assert ch.read(time.monotonic() + 10, "update")["accepted"]
        _send_bytes(pg, new)
        ready = ch.read(time.monotonic() + 20, "update")
        assert ready["ready"] is True and engine.version == version
        if ending == "abort":
            ch.send({"op": "abort"})
            with pytest.raises(WeightSyncError, match="answered 409: update not committed by "
                                                      "the trainer.*previous weights kept"):
                ch.read(time.monotonic() + 20, "commit")
        ch.close()  # no commit can come any more: the weights are never swapped in
        assert engine.version == version
        assert all(torch.equal(p, kept[n]) for n, p in engine.params.items())
    ch = Channel("http://test", "127.0.0.1", channel.port, name, timeout_s=10)
    good = _split(_new_weights(engine, 7))
    _update(ch, name, version + 2, 0, good)
    assert ch.read(time.monotonic() + 10, "update")["accepted"]
    _send_bytes(pg, good)
    assert _commit(ch, version + 2)["weight_version"] == version + 2 == engine.version
    ch.close()


@pytest.mark.timeout(60)
def test_dropping_the_group_closes_the_channel_and_bad_input_is_typed(served):
    engine, channel, pg, name = served
    with pytest.raises(WeightSyncError, match="no weights-update group 'nope'"):
        Channel("http://test", "127.0.0.1", channel.port, "nope", timeout_s=10)
    with socket.create_connection(("127.0.0.1", channel.port), timeout=10) as raw:
        send_frame(raw, {"op": "fly"})
        answer = recv_frame(raw)
        assert answer["success"] is False and "op: must be 'attach' or 'update'" in \
            answer["message"]
    ch = Channel("http://test", "127.0.0.1", channel.port, name, timeout_s=10)
    assert not ch.stale()
    engine.receiver.destroy_group({"group_name": name})
    deadline = time.monotonic() + 10
    while not ch.stale() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ch.stale()  # the server closed it: the trainer knows to set up again
    with pytest.raises(WeightSyncError, match="did the server exit"):
        ch.read(time.monotonic() + 5, "update")
    ch.close()


def test_channel_waits_work_above_file_descriptor_1023():
    """A long-lived trainer holds many descriptors; select() refuses those above 1023, the
    channel's poll does not."""
    import os
    import socket

    from fsdpfn.weights.channel import wait_readable

    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    a, b = socket.socketpair()
    try:
        assert a.fileno() > 1023
        assert wait_readable([a], 0.0) == []
        b.send(b"x")
        assert wait_readable([a], 1.0) == [a]
        b.close()  # a closed peer reads as readable too (the end of the connection)
    finally:
        a.close()
        for fd in held:
            os.close(fd)
