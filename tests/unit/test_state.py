"""EngineState's surface: the scheduler field and its deprecated alias."""

from __future__ import annotations

import pytest

import fsdpfn as ff
from fsdpfn.testing import tiny_qwen2_config


def _state(hf_cfg, **overrides):
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=1), device_type="cpu")
    cfg = ff.EngineConfig(model_config=hf_cfg.to_dict(), dtype="float32", **overrides)
    return ff.shard_model(cfg, mesh)


def test_lr_scheduler_is_a_deprecated_alias_of_scheduler():
    state = _state(tiny_qwen2_config())
    assert state.scheduler is not None
    with pytest.warns(DeprecationWarning, match="use EngineState.scheduler"):
        assert state.lr_scheduler is state.scheduler
    inference = _state(tiny_qwen2_config(), optimizer=None)
    with pytest.warns(DeprecationWarning):
        assert inference.lr_scheduler is None and inference.scheduler is None
