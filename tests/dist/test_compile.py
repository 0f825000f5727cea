"""EngineConfig.compile (every decoder block's forward through torch.compile) computes what the
model's own eager forward computes, on two CPU ranks (gloo, float32) under dp and cp, with and
without activation checkpointing: forward_logp, one sft_step's loss and its update, against HF's
float32 eager model run here. A state built with compile=True really runs compiled blocks, and
activation checkpointing still wraps them. With the per-layer optimizer step (the long-row
recipe's option; the gemma2 case) the compiled blocks' update is still the model's own. tp > 1
is refused on every rank."""

from __future__ import annotations

import pytest

import fsdpfn as ff
from fsdpfn.testing.models import (REFERENCE_STEP, assert_update_matches, compiled_blocks,
                                   engine_update, hf_reference_update, save_family_model,
                                   tiny_family_configs)
from fsdpfn.testing.strategies import batch_from_lengths

LENGTHS = (37, 21, 30, 12)
OPT = REFERENCE_STEP  # the step hf_reference_update computes


def batch_of(seed: int = 0):
    """Four rows of the families' vocabulary (131), the first 3 tokens of each a prompt."""
    return batch_from_lengths(list(LENGTHS), max(LENGTHS), seed=seed, vocab_size=131,
                              prompt_lens=[3] * len(LENGTHS))


def compiled_run(model_dir, cp, checkpointing, batch, per_layer=False):
    """forward_logp twice (two packed lengths: the second compiles the dynamic length), then one
    sft_step: (logp, loss, deltas, (blocks compiled, layers), checkpointed block calls) on
    rank 0."""
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=-1, cp=cp), device_type="cpu")
    cfg = ff.EngineConfig(model_path=model_dir, dtype="float32", compile=True,
                          gradient_checkpointing=checkpointing,
                          fsdp=ff.FSDPConfig(per_layer_optim_step=per_layer),
                          optimizer=ff.OptimizerConfig(**OPT))
    state = ff.shard_model(cfg, mesh)
    assert type(state.optimizer).__name__ == ("PerLayerAdamW" if per_layer else "AdamW")
    compiled = compiled_blocks(state)
    layers = state.hf_config.num_hidden_layers
    checkpointed = []  # activation checkpointing still runs around the compiled blocks
    for m in state.model.modules():
        if "_gradient_checkpointing_func" in m.__dict__:
            func = m._gradient_checkpointing_func
            m._gradient_checkpointing_func = lambda *a, f=func, **k: (checkpointed.append(1),
                                                                     f(*a, **k))[1]
    ff.forward_logp(state, ff.shard_batch(batch[:2], mesh))
    got = engine_update(state, batch, mesh)
    return None if got is None else (*got, (compiled, layers), len(checkpointed))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("compile")
    families = tiny_family_configs()
    return {name: str(save_family_model(root / name, families[name], seed=4))
            for name in ("qwen3", "gemma2")}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("family,cp,checkpointing,per_layer", [
    ("qwen3", 1, False, False), ("qwen3", 2, True, False), ("gemma2", 1, True, True)])
def test_compiled_blocks_equal_the_models_own_forward(family, cp, checkpointing, per_layer, dirs,
                                                      spmd2):
    batch = batch_of()
    *got, compiled, checkpointed = spmd2.run(
        compiled_run, args=(dirs[family], cp, checkpointing, batch),
        kwargs={"per_layer": per_layer}, timeout=500)[0]
    assert compiled[0] == compiled[1], f"{compiled[0]} blocks compiled of {compiled[1]}"
    # one sft_step: every block checkpointed once per micro-batch, none without checkpointing
    assert (checkpointed >= compiled[1]) if checkpointing else checkpointed == 0, checkpointed
    assert_update_matches(f"{family} cp={cp}", tuple(got),
                          hf_reference_update(dirs[family], batch))


def build_tp(model_dir):
    from fsdpfn.errors import ConfigError

    mesh = ff.build_mesh(ff.ParallelStrategy(tp=2), device_type="cpu")
    try:
        ff.shard_model(ff.EngineConfig(model_path=model_dir, compile=True, optimizer=None), mesh)
    except ConfigError as exc:
        return str(exc)
    return None


@pytest.mark.timeout(300)
def test_compile_with_tensor_parallelism_is_refused_on_every_rank(dirs, spmd2):
    messages = spmd2.run(build_tp, args=(dirs["qwen3"],), timeout=200)
    assert all(m is not None and m.startswith("compile:") and "tp=2" in m
               for m in messages), messages
