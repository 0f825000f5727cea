"""DiskTarget's keep_last counts versions by when they were published, the version just pushed
always kept: a trainer resumed from an older checkpoint pushes a lower version than those on
disk, and that push must be published (loadable, with the pushed weights), not deleted by its
own rotation. As save_checkpoint's keep_last counts."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

import fsdpfn as ff
from fsdpfn.testing import random_batch, save_tiny_model, tiny_qwen2_config
from fsdpfn.weights.disk import published_versions


def _state(model_dir):
    mesh = ff.build_mesh(ff.ParallelStrategy(), device_type="cpu")
    return ff.shard_model(ff.EngineConfig(model_path=str(model_dir), dtype="float32",
                                          optimizer=ff.OptimizerConfig(lr=1e-2)), mesh)


def test_a_lower_version_is_published_and_the_most_recent_are_kept(tmp_path):
    model_dir = save_tiny_model(tmp_path / "m", tiny_qwen2_config(), seed=0)
    root = tmp_path / "push"
    state = _state(model_dir)
    for i in range(3):  # versions 1, 2, 3
        state, _ = ff.sft_step(state, random_batch(4, 12, seed=i), ff.SFTConfig())
        assert ff.push_weights(state, ff.DiskTarget(root, keep_last=2)).version == i + 1
    assert [v for v, _ in published_versions(root)] == [2, 3]

    fresh = _state(model_dir)  # version 0: as a run that went back to its start
    receipt = ff.push_weights(fresh, ff.DiskTarget(root, keep_last=2))
    assert receipt.version == 0
    # the push just made and the one published before it
    assert [v for v, _ in published_versions(root)] == [0, 3]
    loaded = AutoModelForCausalLM.from_pretrained(root / "v0", dtype=torch.float32)
    served = dict(loaded.named_parameters())
    # the fresh state's weights are the model directory's
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert all(torch.equal(served[n], p) for n, p in reference.named_parameters())

    ff.push_weights(fresh, ff.DiskTarget(root, keep_last=1))
    assert [v for v, _ in published_versions(root)] == [0]
