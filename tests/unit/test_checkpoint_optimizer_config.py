"""load_checkpoint and a changed OptimizerConfig: the Adam moments and the schedule's position come
from the checkpoint, the hyper-parameters from the loading state's own config (what --resume with
a new optimizer.lr expects), and an unchanged config continues exactly as if never stopped.

References: the schedule's formula written out here, and an uninterrupted run."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

import fsdpfn as ff
from fsdpfn.testing import random_batch

CONFIG = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(11)
    path = tmp_path_factory.mktemp("optcfg")
    AutoModelForCausalLM.from_config(Qwen2Config(**CONFIG)).save_pretrained(path)
    return path


def _state(path, opt):
    mesh = ff.build_mesh(ff.ParallelStrategy(), device_type="cpu")
    return ff.shard_model(ff.EngineConfig(model_path=str(path), dtype="float32", optimizer=opt),
                          mesh)


def _batch(step):
    return random_batch(3, 12, vocab_size=CONFIG["vocab_size"], seed=100 + step)


def _linear(lr, warmup, total, step):
    """The documented schedule: linear warm-up to lr, then linear decay to 0 at total_steps."""
    if step < warmup:
        return lr * (step + 1) / warmup
    return lr * max(0.0, 1.0 - (step - warmup) / max(total - warmup, 1))


def _run(state, steps):
    lrs = []
    for step in steps:
        state, stats = ff.sft_step(state, _batch(step))
        lrs.append(float(stats["lr"]))
    return state, lrs


@pytest.mark.timeout(120)
def test_a_changed_config_applies_from_the_saved_step(model_dir, tmp_path):
    old = ff.OptimizerConfig(lr=1e-2, schedule="linear", warmup_steps=1, total_steps=4,
                             max_grad_norm=None)
    state, _ = _run(_state(model_dir, old), range(2))
    ff.save_checkpoint(state, tmp_path / "ck")
    new = ff.OptimizerConfig(lr=1e-3, schedule="linear", warmup_steps=1, total_steps=8,
                             betas=(0.5, 0.6), eps=1e-4, weight_decay=0.25, max_grad_norm=None)
    resumed, _ = ff.load_checkpoint(_state(model_dir, new), tmp_path / "ck")
    assert resumed.step == 2
    groups = resumed.optimizer.param_groups
    assert {tuple(g["betas"]) for g in groups} == {(0.5, 0.6)}
    assert {g["eps"] for g in groups} == {1e-4}
    assert sorted(g["weight_decay"] for g in groups) == [0.0, 0.25]  # matrices only
    moments = [s["exp_avg"] for s in resumed.optimizer.state.values()]
    assert moments and all(float(m.abs().sum()) > 0 for m in moments)  # the saved moments
    _, lrs = _run(resumed, (2, 3))
    want = [_linear(1e-3, 1, 8, s) for s in (2, 3)]
    assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(lrs, want)), (lrs, want)


@pytest.mark.timeout(120)
def test_an_unchanged_config_continues_as_if_never_stopped(model_dir, tmp_path):
    opt = ff.OptimizerConfig(lr=1e-2, schedule="cosine", warmup_steps=1, total_steps=5,
                             weight_decay=0.1, min_lr_ratio=0.1)
    straight, lrs = _run(_state(model_dir, opt), range(4))
    state, first = _run(_state(model_dir, opt), range(2))
    ff.save_checkpoint(state, tmp_path / "ck")
    resumed, _ = ff.load_checkpoint(_state(model_dir, opt), tmp_path / "ck")
    resumed, rest = _run(resumed, (2, 3))
    assert first + rest == lrs
    for a, b in zip(straight.model.parameters(), resumed.model.parameters()):
        assert torch.equal(a.detach(), b.detach())


def _state_with(path, *, per_layer: bool, optimizer_dtype: str):
    mesh = ff.build_mesh(ff.ParallelStrategy(), device_type="cpu")
    return ff.shard_model(ff.EngineConfig(
        model_path=str(path), dtype="float32", optimizer_dtype=optimizer_dtype,
        optimizer=ff.OptimizerConfig(lr=1e-2), fsdp=ff.FSDPConfig(per_layer_optim_step=per_layer)),
        mesh)


@pytest.mark.parametrize("optimizer_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("saved_per_layer", [False, True], ids=["saved-plain", "saved-per-layer"])
def test_the_per_layer_step_may_change_across_a_resume(model_dir, tmp_path, optimizer_dtype,
                                                       saved_per_layer):
    """The per-layer step keeps the same moments in host memory: a checkpoint of either loads
    into the other, and the resumed steps equal the uninterrupted ones bit for bit."""
    state = _state_with(model_dir, per_layer=saved_per_layer, optimizer_dtype=optimizer_dtype)
    for step in range(2):
        state, _ = ff.sft_step(state, _batch(step), ff.SFTConfig())
    ff.save_checkpoint(state, tmp_path / "ckpt")
    straight = []
    for step in (2, 3):
        state, stats = ff.sft_step(state, _batch(step), ff.SFTConfig())
        straight.append(float(stats["loss"]))
    other = _state_with(model_dir, per_layer=not saved_per_layer,
                        optimizer_dtype=optimizer_dtype)
    other, _ = ff.load_checkpoint(other, tmp_path / "ckpt")
    resumed = []
    for step in (2, 3):
        other, stats = ff.sft_step(other, _batch(step), ff.SFTConfig())
        resumed.append(float(stats["loss"]))
    assert resumed == straight


def test_another_optimizer_dtype_is_refused_naming_it(model_dir, tmp_path):
    state = _state_with(model_dir, per_layer=False, optimizer_dtype="float32")
    state, _ = ff.sft_step(state, _batch(0), ff.SFTConfig())
    ff.save_checkpoint(state, tmp_path / "ckpt")
    bf16 = _state_with(model_dir, per_layer=False, optimizer_dtype="bfloat16")
    with pytest.raises(ff.CheckpointError, match=r"optimizer.class: must be KahanAdamW .*got "
                                                 r"'AdamW'.*optimizer_dtype differs"):
        ff.load_checkpoint(bf16, tmp_path / "ckpt")
    bf16, _ = ff.sft_step(bf16, _batch(0), ff.SFTConfig())  # the refused state is still usable
