"""Starting weights, one tensor at a time (fsdpfn.engine.load_weights).

* HF's random init drawn piece by piece is HF's init: linear weights N(0, initializer_range²),
  zero biases, unit norms, a tied head equal to the embedding; the same seed gives the same
  weights, on every mesh (dp=2 and tp=2 gather to the dp=1 build);
* a checkpoint missing a weight, or holding one in another shape, is refused on every rank with
  a ConfigError naming the weight, with memory_efficient_load and without (no rank waits);
* the build never holds a full copy of the model: the peak memory of a CPU build in a fresh
  process stays within the model plus a few pieces (the whole-model load took 4x the model).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

import fsdpfn as ff
from fsdpfn.testing import save_tiny_model, tiny_qwen2_config


def _full(state) -> dict:
    full = get_model_state_dict(state.model, options=StateDictOptions(full_state_dict=True,
                                                                      cpu_offload=True))
    return {k.removeprefix("lm."): v for k, v in full.items()}


def _random_build(tp: int = 1, seed: int = 5) -> dict:
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=-1, tp=tp), device_type="cpu")
    config = ff.EngineConfig(model_config=tiny_qwen2_config(tie_word_embeddings=True).to_dict(),
                             dtype="float32", seed=seed)
    return _full(ff.shard_model(config, mesh))


@pytest.mark.timeout(120)
def test_random_init_is_hfs_init_the_same_for_a_seed(spmd1):
    full, again, other = spmd1.run(_three_builds, timeout=100)[0]
    std = tiny_qwen2_config().initializer_range
    for key, value in full.items():
        if key.endswith("norm.weight"):
            assert torch.equal(value, torch.ones_like(value)), key
        elif key.endswith(".bias"):
            assert torch.equal(value, torch.zeros_like(value)), key
        else:  # a matrix of >= 2048 draws: its std within 15% of HF's
            assert value.numel() >= 2048 and abs(float(value.std()) / std - 1) < 0.15, key
            assert abs(float(value.mean())) < 4 * std / value.numel() ** 0.5 + 1e-6, key
    assert torch.equal(full["lm_head.weight"], full["model.embed_tokens.weight"])
    assert all(torch.equal(full[k], again[k]) for k in full)
    assert not torch.equal(full["model.layers.0.mlp.up_proj.weight"],
                           other["model.layers.0.mlp.up_proj.weight"])


def _three_builds():
    return _random_build(), _random_build(), _random_build(seed=6)


def _mesh_builds():
    return _random_build(tp=1), _random_build(tp=2)


@pytest.mark.timeout(310)
def test_random_init_is_the_same_on_every_mesh(spmd1, spmd2):
    reference = spmd1.run(_random_build, timeout=100)[0]
    dp2, tp2 = spmd2.run(_mesh_builds, timeout=150)[0]  # rank 0 holds the gathered state
    for built in (dp2, tp2):
        assert built.keys() == reference.keys()
        for key in reference:
            assert torch.equal(built[key], reference[key]), key


def _load_error(path: str, efficient: bool):
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=-1), device_type="cpu")
    try:
        ff.shard_model(ff.EngineConfig(model_path=path, dtype="float32", fsdp=ff.FSDPConfig(
            memory_efficient_load=efficient)), mesh)
    except ff.ConfigError as exc:
        return str(exc)
    return None


@pytest.mark.timeout(300)
@pytest.mark.parametrize("fault", ["missing", "shape"])
def test_a_bad_checkpoint_is_refused_on_every_rank(tmp_path, spmd2, fault):
    path = save_tiny_model(tmp_path / "model", tiny_qwen2_config(), seed=1)
    file = next(path.glob("*.safetensors"))
    tensors = load_file(str(file))
    key = "model.layers.1.mlp.up_proj.weight"
    if fault == "missing":
        del tensors[key]
    else:
        tensors[key] = tensors[key][:-1].clone()
    save_file(tensors, str(file), metadata={"format": "pt"})
    for efficient in (True, False):
        errors = spmd2.run(_load_error, args=(str(path), efficient), timeout=120)
        assert all(e is not None for e in errors), errors  # every rank raised, none waits
        assert key in errors[0], errors  # the rank that read the checkpoint names the weight
        if fault == "shape":
            assert "must have shape" in errors[0]


_PEAK = textwrap.dedent("""
    import json, torch
    import fsdpfn as ff
    from fsdpfn.testing import tiny_qwen2_config

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024

    def rss():
        return status("VmRSS:")

    cfg = tiny_qwen2_config(vocab_size=1024, hidden_size=1024, intermediate_size=2816,
                            num_hidden_layers=16, num_attention_heads=8,
                            num_key_value_heads=4).to_dict()
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=1), device_type="cpu")
    base = rss()
    state = ff.shard_model(ff.EngineConfig(model_config=cfg, lora=ff.LoRAConfig(rank=4),
                                           dtype="bfloat16", optimizer=None), mesh)
    # VmHWM is this process's own peak (ru_maxrss keeps the peak of the process that started
    # it, a large pytest worker, across fork and exec)
    peak = status("VmHWM:")
    model = sum(p.to_local().numel() * p.to_local().element_size()
                for p in state.model.parameters())
    layer = sum(p.numel() for p in state.hf_model.model.layers[0].parameters()) * 4
    print(json.dumps(dict(peak=peak - base, model=model, layer=layer)))
""")


@pytest.mark.timeout(300)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_the_build_never_holds_a_full_copy_of_the_model():
    """A 16-layer LoRA model (bf16 base, 0.4 GB): the fp32 random init drawn whole and loaded in
    one piece peaked at 4x the model; one piece at a time, at the model plus a few layers."""
    out = subprocess.run([sys.executable, "-c", _PEAK], capture_output=True, text=True,
                         timeout=280, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    limit = got["model"] + 4 * got["layer"] + 96 * 2**20
    assert got["peak"] < limit, (got, limit)
