"""load_checkpoint and the config fields that change the forward for the same weights (rope_theta,
a sliding window, ...; ``fsdpfn.wire.model_fingerprint``): a checkpoint saved under other values
loads, as continued training under a longer rotary base does on purpose, with a UserWarning that
names each field and both values; under the same config nothing is said."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

import fsdpfn as ff
from fsdpfn.testing import random_batch

CONFIG = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def _model_dir(root, name, **overrides):
    torch.manual_seed(3)
    path = root / name
    AutoModelForCausalLM.from_config(Qwen2Config(**CONFIG, **overrides)).save_pretrained(path)
    return path


def _state(path):
    mesh = ff.build_mesh(ff.ParallelStrategy(), device_type="cpu")
    return ff.shard_model(ff.EngineConfig(model_path=str(path), dtype="float32",
                                          optimizer=ff.OptimizerConfig(lr=1e-2)), mesh)


def _full(state) -> dict:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in state.model.state_dict().items()}


@pytest.mark.timeout(120)
def test_other_rope_theta_loads_with_a_warning_naming_it(tmp_path):
    base = _model_dir(tmp_path, "base")
    longer = _model_dir(tmp_path, "longer", rope_parameters={"rope_type": "default",
                                                               "rope_theta": 500000.0})
    state, _ = ff.sft_step(_state(base), random_batch(3, 12, vocab_size=96, seed=1))
    ff.save_checkpoint(state, tmp_path / "ck")
    saved = json.loads((tmp_path / "ck" / "fsdpfn.json").read_text())["config_fields"]
    assert saved["rope_parameters.rope_theta"] == 10000
    trained = _full(state)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same config: not a word
        again, _ = ff.load_checkpoint(_state(base), tmp_path / "ck")
    with pytest.warns(UserWarning, match=r"rope_parameters\.rope_theta: 10000 saved, 500000 here"):
        loaded, _ = ff.load_checkpoint(_state(longer), tmp_path / "ck")
    assert loaded.step == state.step == again.step
    for key, value in _full(loaded).items():
        torch.testing.assert_close(value, trained[key], rtol=0, atol=0)
