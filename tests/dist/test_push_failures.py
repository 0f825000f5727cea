"""A push that fails leaves every server as it was and free for the next push, with real rollout
server processes and a trainer rank:

- a commit the model lock holds up (a long generation on the CPU path) is answered as a
  failure before the trainer gives up, and the server keeps its weights afterwards too (it once
  swapped them in after the trainer had reported the push failed);
- one server's refusal frees the others at once (a server that had accepted waited the whole
  timeout for bytes that never came, and the next push to it failed for minutes);
- a disk push every server refused leaves no copy of the weights on disk.

The references are the servers' own answers (/get_model_info) and the files on disk.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

import fsdpfn as ff
from fsdpfn.rollout import launch_server
from fsdpfn.testing import random_batch, save_tiny_model, tiny_qwen2_config
from fsdpfn.wire.http import call

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("push") / "tiny", tiny_qwen2_config(),
                               seed=0))


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory):
    """A model of other shapes: its server refuses the trainer's weights."""
    return str(save_tiny_model(tmp_path_factory.mktemp("push") / "other",
                               tiny_qwen2_config(intermediate_size=96), seed=0))


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("logs")


def _state(path):
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=-1), device_type="cpu")
    state = ff.shard_model(ff.EngineConfig(model_path=path, dtype="float32",
                                           optimizer=ff.OptimizerConfig(lr=1e-2)), mesh)
    state, _ = ff.sft_step(state, random_batch(4, 12, seed=0))
    return state


def push_while_a_generation_holds_the_model(path, url, flag):
    state = _state(path)
    target = ff.RolloutTarget(url, config=ff.PushConfig(timeout_s=4))
    ff.push_weights(state, target)  # the group and channel set up; the server at version 1
    state, _ = ff.sft_step(state, random_batch(4, 12, seed=1))
    open(flag, "w").close()  # the test starts its long generation
    time.sleep(1.5)
    try:
        ff.push_weights(state, target)
        return state.version, None
    except ff.WeightSyncError as exc:
        return state.version, str(exc)
    finally:
        target.close()


@pytest.mark.timeout(240)
def test_a_commit_held_up_by_the_model_lock_fails_and_the_server_keeps_its_weights(
        spmd1, model_dir, logs, tmp_path):
    flag = str(tmp_path / "go")
    with launch_server(model_dir, log_dir=logs, health_timeout=120) as server:
        done = {}

        def long_generation():  # HF generate holds the model lock for the whole request
            while not os.path.exists(flag):
                time.sleep(0.05)
            done["answer"] = call(server.url, "/generate", {
                "input_ids": [[1, 2, 3]] * 256, "sampling_params": {
                    "max_new_tokens": 400, "ignore_eos": True}}, timeout=200)

        thread = threading.Thread(target=long_generation)
        thread.start()
        version, error = spmd1.run(push_while_a_generation_holds_the_model,
                                   args=(model_dir, server.url, flag), timeout=200)[0]
        thread.join(200)
        assert version == 2 and error is not None and "previous weights kept" in error, error
        time.sleep(0.5)  # a swap that waited for the lock would have landed by now
        assert server.get("/get_model_info")["version"] == 1
        assert "previous weights kept" in server.get("/get_model_info")["last_error"]


def push_after_a_refusal(path, good, bad):
    state = _state(path)
    config = ff.PushConfig(timeout_s=60, init_timeout_s=20, precheck=False)
    try:
        ff.push_weights(state, ff.RolloutTarget([good, bad], config=config))
        first = None
    except ff.WeightSyncError as exc:
        first = str(exc)
    t = time.monotonic()
    receipt = ff.push_weights(state, ff.RolloutTarget(good, config=config))
    return first, receipt.version, time.monotonic() - t


@pytest.mark.timeout(240)
def test_a_refusal_by_one_server_frees_the_others_for_the_next_push(
        spmd1, model_dir, other_dir, logs):
    with launch_server(model_dir, log_dir=logs, health_timeout=120) as good, \
            launch_server(other_dir, log_dir=logs, health_timeout=120) as bad:
        first, version, seconds = spmd1.run(push_after_a_refusal,
                                            args=(model_dir, good.url, bad.url), timeout=200)[0]
        assert first is not None and "refused before any byte was sent" in first, first
        # the good server had accepted and waited for bytes: the trainer's closed channel ends
        # that wait, so the next push is not held for the 60 s timeout
        assert version == 1 and seconds < 20, seconds
        assert good.get("/get_model_info")["version"] == 1


def refused_disk_pushes(path, bad, root):
    state = _state(path)
    config = ff.PushConfig(transport="disk", disk_root=root, precheck=False, timeout_s=60,
                           keep_last=1)
    seen = []
    for step in range(2):
        state, _ = ff.sft_step(state, random_batch(4, 12, seed=step + 1))
        with pytest.raises(ff.WeightSyncError, match="rejected, previous weights kept"):
            ff.push_weights(state, ff.RolloutTarget(bad, config=config))
        seen.append(sorted(os.listdir(root)))
    return seen


@pytest.mark.timeout(240)
def test_a_disk_push_every_server_refused_leaves_no_copy_on_disk(
        spmd1, model_dir, other_dir, logs, tmp_path):
    root = tmp_path / "pushed"
    root.mkdir()
    stale = root / ".tmp-v0-deadbeef"  # a crashed write's, long ago
    stale.mkdir()
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    with launch_server(other_dir, log_dir=logs, health_timeout=120) as bad:
        seen = spmd1.run(refused_disk_pushes, args=(model_dir, bad.url, str(root)),
                         timeout=200)[0]
        assert bad.get("/get_model_info")["version"] == 0
    assert seen == [[".tmp-v0-deadbeef"], [".tmp-v0-deadbeef"]], seen
    from fsdpfn.weights.disk import rotate
    rotate(root, 1, root / "v9")
    assert not stale.exists()
