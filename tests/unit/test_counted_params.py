"""The memory estimate's parameter counts come from the model's safetensors headers where they
read as its layers, so a family whose layer is not llama-shaped (GPT-2's, OPT's and Falcon's
two-matrix MLPs, position embeddings, biases) is counted exactly: the reference is the number
of parameters of the model transformers builds from the same directory."""

from __future__ import annotations

import json
import struct

import pytest
import torch

from fsdpfn.app.recipes.memory import ModelShape
from fsdpfn.app.recipes.model import text_model_config
from fsdpfn.engine.weight_files import counted_params

SMALL = dict(vocab_size=97)


def _save(path, model_type: str, **fields):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **fields))
    model.save_pretrained(path)
    return model


@pytest.mark.parametrize("model_type, fields", [
    ("gpt2", dict(n_embd=32, n_layer=3, n_head=4, n_positions=64)),
    ("opt", dict(hidden_size=32, num_hidden_layers=3, num_attention_heads=4, ffn_dim=80,
                 word_embed_proj_dim=32, max_position_embeddings=64)),
    ("falcon", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4)),
    ("qwen2", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2)),
    ("llama", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)),
])
def test_the_estimate_counts_what_transformers_builds(tmp_path, model_type, fields):
    model = _save(tmp_path, model_type, **SMALL, **fields)
    want = sum(p.numel() for p in model.parameters())  # tied weights once
    shape = ModelShape.from_hf(text_model_config(tmp_path)).counted(tmp_path)
    assert shape.counted_layer is not None
    assert shape.params == want, (model_type, shape.params, want)


def test_files_that_do_not_read_as_the_layers_keep_the_formulas(tmp_path):
    _save(tmp_path, "qwen2", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
          num_attention_heads=4, num_key_value_heads=2, **SMALL)
    assert counted_params(tmp_path, 2) is not None
    assert counted_params(tmp_path, 3) is None  # not the config's number of layers
    assert counted_params(tmp_path / "none", 2) is None  # no files
    shape = ModelShape.from_hf(text_model_config(tmp_path))
    assert shape.counted(tmp_path / "none") == shape
    # quantized weights (integer tensors) are not counted as parameters
    header = json.dumps({"model.layers.0.mlp.qweight": {"dtype": "I32", "shape": [8, 8],
                                                        "data_offsets": [0, 256]}}).encode()
    q = tmp_path / "q"
    q.mkdir()
    (q / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(256))
    assert counted_params(q, 1) is None
    (q / "model.safetensors").write_bytes(b"\x01\x02")  # unreadable
    assert counted_params(q, 1) is None
