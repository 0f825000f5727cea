"""EngineState's surface: the HF module under Hugging Face's own names, the scheduler field and
its deprecated alias."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict

import fsdpfn as ff
from fsdpfn.testing import tiny_qwen2_config


def _state(hf_cfg, **overrides):
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=1), device_type="cpu")
    cfg = ff.EngineConfig(model_config=hf_cfg.to_dict(), dtype="float32", **overrides)
    return ff.shard_model(cfg, mesh)


def _hf_keys(hf_cfg) -> set[str]:
    """The reference: Hugging Face's own model, built independently of fsdpfn."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return set(AutoModelForCausalLM.from_config(hf_cfg).state_dict())


@pytest.mark.parametrize("tied", [False, True])
def test_hf_model_has_hugging_face_names(tied):
    hf_cfg = tiny_qwen2_config(tie_word_embeddings=tied)
    state = _state(hf_cfg)
    want = _hf_keys(hf_cfg)
    assert "model.layers.0.self_attn.q_proj.weight" in want
    assert state.hf_model is state.model.lm
    assert set(get_model_state_dict(state.hf_model)) == want
    named = {name for name, _ in state.hf_model.named_parameters()}
    # tied embeddings: named_parameters lists the shared tensor once (as embed_tokens), the
    # state dict under both names
    assert named == (want - {"lm_head.weight"} if tied else want)
    wrapped = set(get_model_state_dict(state.model))  # the internal wrapper's names differ
    assert wrapped == {f"lm.{k}" for k in want}


def test_hf_model_parameters_are_the_engines():
    state = _state(tiny_qwen2_config())
    engine = {id(p) for _, p in state.model.named_parameters()}
    assert {id(p) for _, p in state.hf_model.named_parameters()} == engine


def test_lr_scheduler_is_a_deprecated_alias_of_scheduler():
    state = _state(tiny_qwen2_config())
    assert state.scheduler is not None
    with pytest.warns(DeprecationWarning, match="use EngineState.scheduler"):
        assert state.lr_scheduler is state.scheduler
    inference = _state(tiny_qwen2_config(), optimizer=None)
    with pytest.warns(DeprecationWarning):
        assert inference.lr_scheduler is None and inference.scheduler is None
