"""When an IPC push hands the trainer's cached blocks back first (fsdpfn.weights.ipc): only where
the GPU cannot hold the trainer's buffers of the buckets and each server's copy of them, with
the headroom to spare."""

from __future__ import annotations

from fsdpfn.weights.ipc import HEADROOM, hand_back_needed

GB = 10 ** 9


def test_a_1p5b_push_with_room_keeps_the_cache():
    # the 1.5B main job: 3.09 GB of buckets, one server, tens of GB free after the step
    assert not hand_back_needed(60 * GB, int(3.09 * GB), 1)


def test_a_7b_push_after_a_step_that_cached_the_gpu_hands_back():
    # the Qwen2-7B example: 15.2 GB of buckets, the trainer's cache holding the GPU
    assert hand_back_needed(10 * GB, int(15.2 * GB), 1)


def test_the_rule_counts_the_buffers_every_servers_copy_and_the_headroom():
    b = 4 * GB
    assert not hand_back_needed(2 * b + HEADROOM, b, 1)
    assert hand_back_needed(2 * b + HEADROOM - 1, b, 1)
    assert not hand_back_needed(3 * b + HEADROOM, b, 2)
    assert hand_back_needed(3 * b + HEADROOM - 1, b, 2)
    assert hand_back_needed(2 * b + HEADROOM - 1, b, 0)  # no server named: counted as one
