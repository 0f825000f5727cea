"""Windowed, softcapped and fused-projection families under tp=2 and cp=2 (two CPU ranks, gloo,
float32) equal the model's own eager forward, as dp=1 does (tests/unit/test_families.py):
forward_logp, one sft_step's loss and its update. Phi-3's fused projections and OLMo-2's
whole-projection q/k norms are refused under tp with a ConfigError on every rank. export_hf of every family variant reloads in plain
transformers with identical logits."""

from __future__ import annotations

import pytest
import torch

import fsdpfn as ff
from fsdpfn import keys as K
from fsdpfn.errors import ConfigError
from fsdpfn.testing.models import (REFERENCE_STEP, assert_update_matches, engine_update,
                                   hf_reference_update, save_family_model, tiny_family_configs)

FAMILIES = tiny_family_configs()
# longrope (Phi-3.5's): the long factors past original_max_position_embeddings (60: only the
# longest row of family_batch, 64 tokens, reaches it, so a cp rank without its last positions
# would pick the short ones); like dynamic NTK it rotates with the highest position of the call
FAMILIES["phi3-longrope"] = {
    **FAMILIES["phi3"], "max_position_embeddings": 128, "original_max_position_embeddings": 60,
    "rope_scaling": {"rope_type": "longrope", "long_factor": [1.0 + 0.5 * i for i in range(8)],
                     "short_factor": [1.0 + 0.1 * i for i in range(8)]}}
LENGTHS = (64, 41, 53, 47)
OPT = REFERENCE_STEP  # the step hf_reference_update computes


def family_batch(seed: int = 0):
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(seed)
    T = max(LENGTHS)
    attn = torch.arange(T)[None] < torch.tensor(LENGTHS)[:, None]
    ids = torch.where(attn, torch.randint(0, 131, (len(LENGTHS), T), generator=g), 0)
    loss = attn.clone()
    loss[:, :3] = False
    return TensorDict({K.INPUT_IDS: ids, K.ATTENTION_MASK: attn, K.LOSS_MASK: loss},
                      batch_size=[len(LENGTHS)])


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families_dist")
    return {name: str(save_family_model(root / name, FAMILIES[name], seed=4))
            for name in ("gemma2", "mistral", "phi3", "gemma3_text", "qwen2-sliding", "olmo2",
                         "gemma", "llama-rope-yarn", "qwen3", "llama-rope-dynamic",
                         "phi3-longrope")}


def run_on_ranks(model_dir, tp, cp, batch, checkpointing=False, n_mbs=1):
    """forward_logp, then one sft_step: (logp, loss, parameter deltas) on rank 0."""
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=-1, tp=tp, cp=cp), device_type="cpu")
    cfg = ff.EngineConfig(model_path=model_dir, dtype="float32",
                          optimizer=ff.OptimizerConfig(**OPT),
                          gradient_checkpointing=checkpointing,
                          mb_spec=ff.MicroBatchSpec(n_mbs=n_mbs))
    return engine_update(ff.shard_model(cfg, mesh), batch, mesh)


@pytest.mark.timeout(500)
@pytest.mark.parametrize("family,tp,cp", [
    ("gemma2", 2, 1), ("gemma2", 1, 2), ("mistral", 2, 1), ("mistral", 1, 2),
    ("gemma3_text", 1, 2), ("gemma3_text", 2, 1), ("qwen2-sliding", 2, 1), ("phi3", 1, 2),
    ("olmo2", 1, 2), ("gemma", 2, 1), ("gemma", 1, 2), ("qwen2-sliding", 1, 2), ("llama-rope-yarn", 2, 1), ("llama-rope-yarn", 1, 2),
    ("qwen3", 2, 1), ("qwen3", 1, 2),
    # rotaries that follow the call's highest position: a cp rank holds only some positions
    # of the pack (rows of 41 to 64 tokens, past max_position_embeddings 32 or longrope's
    # original 60) and must still rotate them as the whole pack
    ("llama-rope-dynamic", 1, 2), ("phi3-longrope", 1, 2),
    # and at dp=2: shard_batch leaves the 64-token row on one rank, and the other rank's rows
    # (53 and 47 tokens) must still rotate with it, as on the padded batch (each rank rotated
    # with its own longest row: dynamic 3e-3 nats off, longrope's short factors 4e-2)
    ("llama-rope-dynamic", 1, 1), ("phi3-longrope", 1, 1)])
def test_tp_and_cp_equal_the_models_own_forward(family, tp, cp, dirs, spmd2):
    batch = family_batch()
    got = spmd2.run(run_on_ranks, args=(dirs[family], tp, cp, batch), timeout=400)[0]
    assert_update_matches(f"{family} tp={tp} cp={cp}", got,
                          hf_reference_update(dirs[family], batch))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["llama-rope-dynamic", "phi3-longrope"])
def test_length_following_rotaries_do_not_depend_on_the_micro_batches(family, dirs, spmd1):
    """One row a micro-batch (n_mbs=4): every micro-batch rotates with the batch's longest row,
    as the padded batch does, not with its own row's length."""
    batch = family_batch()
    got = spmd1.run(run_on_ranks, args=(dirs[family], 1, 1, batch),
                    kwargs={"n_mbs": 4}, timeout=250)[0]
    assert_update_matches(f"{family} n_mbs=4", got, hf_reference_update(dirs[family], batch))


def logp_after_a_longer_batch(model_dir, first, second):
    """forward_logp of ``first``, then of ``second``: the second's log-probs."""
    mesh = ff.build_mesh(ff.ParallelStrategy(), device_type="cpu")
    state = ff.shard_model(ff.EngineConfig(model_path=model_dir, dtype="float32",
                                           optimizer=None), mesh)
    ff.forward_logp(state, first)
    return ff.forward_logp(state, second)[K.LOGP]


@pytest.mark.timeout(300)
def test_a_dynamic_rotary_forgets_the_longer_batches_before_it(dirs, spmd1):
    """transformers' dynamic NTK rotary keeps the longest length it has seen and rotates later,
    shorter calls with it: the engine resets it each call, so a batch's log-probs are those of
    a freshly loaded model's forward, whatever ran before."""
    from transformers import AutoModelForCausalLM

    from fsdpfn.testing.models import hf_reference_logp

    from tensordict import TensorDict

    rest = family_batch(seed=1)[1:]  # rows of 41, 53 and 47 tokens, padded to their own 53
    second = TensorDict({k: v[:, :53] for k, v in rest.items()}, batch_size=[3])
    first = family_batch()  # padded to 64
    got = spmd1.run(logp_after_a_longer_batch, args=(dirs["llama-rope-dynamic"], first, second),
                    timeout=250)[0]
    fresh = AutoModelForCausalLM.from_pretrained(dirs["llama-rope-dynamic"],
                                                 dtype=torch.float32, attn_implementation="eager")
    want, _ = hf_reference_logp(fresh, second[K.INPUT_IDS], second[K.ATTENTION_MASK])
    gap = float((got - want).abs().max())
    assert gap <= 1e-5, f"logp gap {gap:.3g} after a longer batch"


@pytest.mark.timeout(300)
def test_a_family_whose_layers_drop_the_packed_keywords_is_exact_at_cp2(tmp_path, spmd2):
    # StableLM's layers call their attention without the pack's keywords; under cp the Ulysses
    # attention needs them too (the cp group and the whole pack's boundaries), in the forward
    # and in activation checkpointing's recomputation
    from fsdpfn.testing.models import _common, exact_here

    spec = _common({"model_type": "stablelm", "vocab_size": 131, "qk_layernorm": True,
                    "pad_token_id": 0})  # transformers 5.0 reads it
    if not exact_here("stablelm"):
        pytest.skip("this transformers refuses stablelm (tests/unit/test_model_guard.py)")
    path = str(save_family_model(tmp_path / "stablelm", spec, seed=4))
    batch = family_batch()
    got = spmd2.run(run_on_ranks, args=(path, 1, 2, batch, True), timeout=200)[0]
    assert_update_matches("stablelm cp=2 checkpointing", got, hf_reference_update(path, batch))


def build_tp(model_dir):
    mesh = ff.build_mesh(ff.ParallelStrategy(tp=2), device_type="cpu")
    try:
        ff.shard_model(ff.EngineConfig(model_path=model_dir, dtype="float32", optimizer=None),
                       mesh)
    except ConfigError as exc:
        return str(exc)
    return None


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family,named", [("phi3", "qkv_proj"), ("olmo2", "self_attn.q_norm")])
def test_what_tp_would_split_wrongly_is_refused_on_every_rank(family, named, dirs, spmd2):
    messages = spmd2.run(build_tp, args=(dirs[family],), timeout=200)
    assert all(m is not None and "ParallelStrategy.tp" in m and f"'{family}'" in m
               and named in m and m.endswith("got tp=2") for m in messages), messages


def export_and_reload(model_dir, out_dir):
    mesh = ff.build_mesh(ff.ParallelStrategy(), device_type="cpu")
    state = ff.shard_model(ff.EngineConfig(model_path=model_dir, dtype="float32",
                                           optimizer=None), mesh)
    ff.export_hf(state, out_dir, dtype="float32")


@pytest.mark.timeout(500)
def test_export_hf_reloads_with_identical_logits(tmp_path, spmd1):
    batch = family_batch(seed=2)
    for name, spec in FAMILIES.items():
        src = str(save_family_model(tmp_path / f"{name}-src", spec, seed=5))
        out = str(tmp_path / f"{name}-out")
        spmd1.run(export_and_reload, args=(src, out), timeout=200)
        from transformers import AutoModelForCausalLM

        with torch.no_grad():
            logits = [AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32,
                                                           attn_implementation="eager")(
                input_ids=batch[K.INPUT_IDS],
                attention_mask=batch[K.ATTENTION_MASK].long()).logits for d in (src, out)]
        torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=0, msg=name)


@pytest.mark.timeout(300)
def test_an_unverified_family_is_refused_under_tp_on_every_rank(tmp_path, spmd2):
    # BitNet passes the guard at tp=1 (its forward equals its own), but its sub-norms over the
    # attention output and the MLP's intermediate width compute across what tp splits: under
    # tp=2 it failed inside forward_logp. The guard checks tp=1 only, so an unverified family
    # is refused under tp by name, on every rank, before any weight moves.
    from transformers import AutoConfig, AutoModelForCausalLM

    from fsdpfn.testing.models import _common

    config = AutoConfig.for_model(**_common({"model_type": "bitnet", "vocab_size": 131}))
    AutoModelForCausalLM.from_config(config).save_pretrained(str(tmp_path / "bitnet"))
    messages = spmd2.run(build_tp, args=(str(tmp_path / "bitnet"),), timeout=200)
    assert all(m is not None and m.startswith("ParallelStrategy.tp:") and "'bitnet'" in m
               and "verify_model='never'" in m and "tp=2" in m for m in messages), messages
    # the families it names are those verified at tp, not the two refused there
    verified = messages[0].split("tensor parallelism is verified for ")[1].split(";")[0]
    assert "llama" in verified and "phi3" not in verified and "olmo2" not in verified, verified
