"""What a loss_fn and an Objective may hand the engine, refused by name when they cannot apply.

A stat named like one the engine reports (loss, grad_norm, lr, tokens, skipped, steps) replaced
the engine's or was replaced by it without a word; a stat that is not one number, or a name
that is not a string, failed deep inside torch or Python; an Objective's with_entropy or
temperature on a critic was dropped; its require given as one string was split into letters;
its bools took any truthy value. Each is a ConfigError naming the field or stat, raised before
any optimizer step, the state usable after it (the next valid step equals one from a state
that never saw the refused call).
"""

from __future__ import annotations

import pytest
import torch

import fsdpfn as ff
from fsdpfn import keys as K
from fsdpfn.errors import ConfigError
from fsdpfn.testing import random_batch, tiny_qwen2_config
from fsdpfn.testing.models import full_model_state

OPT = ff.OptimizerConfig(lr=1e-2, weight_decay=0.0, max_grad_norm=None)


def _state(critic: bool = False):
    mesh = ff.build_mesh(ff.ParallelStrategy(), device_type="cpu")
    return ff.shard_model(ff.EngineConfig(model_config=tiny_qwen2_config().to_dict(),
                                          is_critic=critic, dtype="float32", seed=3,
                                          optimizer=OPT), mesh)


def _nll(outputs, mb, ctx):
    return -(outputs[K.LOGP] * mb[K.LOSS_MASK]).sum()


@pytest.mark.parametrize("stats, match", [
    ({"loss": torch.tensor(0.0)}, r"^loss_fn: stat 'loss' is one the engine reports itself"),
    ({"grad_norm": 7.0}, r"^loss_fn: stat 'grad_norm' is one the engine reports itself"),
    ({"tokens": 1.0}, r"^loss_fn: stat 'tokens' is one the engine reports itself"),
    ({"per_row": "rows"}, r"^loss_fn: stat 'per_row' must be a number or a 0-dim tensor, got "
                          r"'rows'"),
    ({"per_row": None}, r"^loss_fn: stat 'per_row' must be a number or a 0-dim tensor"),
    ({3: 1.0}, r"^loss_fn: stat names must be non-empty strings, got 3"),
])
def test_a_stat_the_engine_cannot_report_is_refused_and_the_state_steps_as_new(stats, match):
    batch = random_batch(4, 12, seed=1, min_len=6)
    state = _state()
    with pytest.raises(ConfigError, match=match):
        ff.grad_step(state, batch, lambda o, mb, c: (_nll(o, mb, c), stats))
    with pytest.raises(ConfigError, match=match):
        ff.evaluate(state, batch, lambda o, mb, c: (_nll(o, mb, c), stats))
    stepped, out = ff.grad_step(state, batch, lambda o, mb, c: (_nll(o, mb, c), {}))
    fresh, _ = ff.grad_step(_state(), batch, lambda o, mb, c: (_nll(o, mb, c), {}))
    mine, theirs = full_model_state(stepped), full_model_state(fresh)
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
    assert out["steps"].item() == 1.0


def test_a_stat_of_many_values_is_refused_by_name():
    """A per-row tensor (the sum over T left out) was a RuntimeError from a reshape."""
    batch = random_batch(4, 12, seed=1, min_len=6)
    with pytest.raises(ConfigError, match=r"stat 'per_row' must be a number or a 0-dim tensor"):
        ff.grad_step(_state(), batch, lambda o, mb, c: (
            _nll(o, mb, c), {"per_row": o[K.LOGP].sum(-1).detach()}))


@pytest.mark.parametrize("dtype", [torch.complex64, torch.int64])
def test_a_loss_that_is_not_a_real_float_is_refused_before_any_backward(dtype):
    """A complex loss sum reached torch's backward, whose RuntimeError named no field."""
    batch = random_batch(4, 12, seed=1, min_len=6)
    state = _state()
    with pytest.raises(ConfigError, match=r"^loss_fn: must return a 0-dim floating-point tensor "
                                          r"loss sum, got tensor\("):
        ff.grad_step(state, batch, lambda o, mb, c: (_nll(o, mb, c).to(dtype), {}))
    stepped, _ = ff.grad_step(state, batch, lambda o, mb, c: (_nll(o, mb, c), {}))
    fresh, _ = ff.grad_step(_state(), batch, lambda o, mb, c: (_nll(o, mb, c), {}))
    mine, theirs = full_model_state(stepped), full_model_state(fresh)
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)


def test_the_users_own_stats_come_back_beside_the_engines():
    batch = random_batch(4, 12, seed=1, min_len=6)
    _, out = ff.grad_step(_state(), batch, lambda o, mb, c: (
        _nll(o, mb, c), {"nll_sum": _nll(o, mb, c).detach(), "count": 2}))
    assert {"loss", "nll_sum", "count", "grad_norm", "lr", "tokens", "skipped",
            "steps"} <= set(out.keys())
    assert out["nll_sum"].item() == pytest.approx(out["loss"].item(), rel=1e-6)


@pytest.mark.parametrize("kwargs, match", [
    (dict(require="advantages"), r"^require: must be a sequence of batch key names \(one key: "
                                 r"\('advantages',\)\), got 'advantages'"),
    (dict(require=("loss_mask", "")), r"^require: must hold non-empty key names"),
    (dict(with_entropy="no"), r"^with_entropy: must be a bool, got 'no'"),
    (dict(pairs=1), r"^pairs: must be a bool, got 1"),
    (dict(temperature="hot"), r"^temperature: must be a finite number >= 1e-06 \(.*\), got 'hot'"),
    (dict(temperature=0.0), r"^temperature: must be a finite number >= 1e-06 \(.*\), got 0.0"),
    (dict(name=5), r"^name: must be a non-empty string, got 5"),
    (dict(critic=True, with_entropy=True), r"^with_entropy: applies to policy states .*"
                                           r"critic=True, got True"),
    (dict(critic=True, temperature=0.5), r"^temperature: applies to policy states .*"
                                         r"critic=True, got 0.5"),
])
def test_an_objectives_option_of_the_wrong_kind_is_refused_by_name(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        ff.Objective(_nll, **kwargs)


def test_actor_options_on_a_critic_state_are_refused_not_dropped():
    """A critic's outputs have no entropy and its values no temperature: an Objective that
    asks for them on a critic state ran, and the options were dropped."""
    batch = random_batch(4, 12, seed=1, min_len=6)
    batch[K.RETURNS] = torch.randn(batch[K.INPUT_IDS].shape) * batch[K.LOSS_MASK]
    critic = _state(critic=True)

    def value_loss(outputs, mb, ctx):
        return ((outputs[K.VALUES] - mb[K.RETURNS]) ** 2 * mb[K.LOSS_MASK]).sum(), {}

    for option, match in ((dict(with_entropy=True), r"^with_entropy: applies to policy states"),
                          (dict(temperature=0.7), r"^temperature: applies to policy states")):
        objective = ff.Objective(value_loss, require=(K.LOSS_MASK, K.RETURNS), **option)
        with pytest.raises(ConfigError, match=match + r".*the state is a critic"):
            ff.evaluate(critic, batch, objective)
        with pytest.raises(ConfigError, match=match):
            ff.grad_step(critic, batch, objective)
    ff.evaluate(critic, batch, ff.Objective(value_loss, require=(K.LOSS_MASK, K.RETURNS)))


def test_forward_logps_with_entropy_is_a_bool():
    batch = random_batch(2, 12, seed=1, min_len=6)
    with pytest.raises(ConfigError, match=r"^with_entropy: must be a bool, got 'no'"):
        ff.forward_logp(_state(), batch, with_entropy="no")


def test_a_model_config_field_transformers_refuses_is_a_config_error():
    """transformers' strict config fields raise huggingface_hub's own error type, which passed
    through shard_model untyped; transformers before them (5.0) took the text, and the build
    failed in torch with a TypeError naming no field. Both are a ConfigError naming it."""
    mesh = ff.build_mesh(ff.ParallelStrategy(), device_type="cpu")
    for field, value, rule in (("hidden_size", "big", "a number"),
                               ("tie_word_embeddings", "yes", "true or false")):
        config = ff.EngineConfig(model_config={**tiny_qwen2_config().to_dict(), field: value},
                                 dtype="float32")
        with pytest.raises(ConfigError, match=rf"^model_config\.{field}: must be {rule}, as "
                                              rf"Qwen2Config's default .* is, got '{value}'"):
            ff.shard_model(config, mesh)
    for field, value in (("vocab_size", -3), ("num_hidden_layers", 0), ("head_dim", 2.5)):
        config = ff.EngineConfig(model_config={**tiny_qwen2_config().to_dict(), field: value},
                                 dtype="float32")
        with pytest.raises(ConfigError, match=rf"^model_config\.{field}: must be an int >= 1 "
                                              rf"\(or a list of them, one per layer\), "
                                              rf"got {value}$"):
            ff.shard_model(config, mesh)
    layers = {**tiny_qwen2_config().to_dict(), "intermediate_size": [128, 0]}
    with pytest.raises(ConfigError, match=r"^model_config\.intermediate_size: .* got \[128, 0\]"):
        ff.shard_model(ff.EngineConfig(model_config=layers, dtype="float32"), mesh)


def test_a_rope_theta_that_transformers_would_drop_or_cannot_use_is_refused():
    """A model's to_dict() with rope_theta changed: transformers reads rope_parameters and
    dropped the new base without a word, so the model trained was not the one configured. A
    text (YAML 1.1 reads 1e6 as one) failed in the rotary's arithmetic with a TypeError."""
    mesh = ff.build_mesh(ff.ParallelStrategy(), device_type="cpu")
    spec = tiny_qwen2_config().to_dict()
    assert spec["rope_parameters"]["rope_theta"] == 10000.0
    with pytest.raises(ConfigError, match=r"^model_config\.rope_theta: 1000000\.0 disagrees "
                                          r"with model_config\.rope_parameters\['rope_theta'\] "
                                          r"= 10000\.0"):
        ff.shard_model(ff.EngineConfig(model_config={**spec, "rope_theta": 1e6},
                                       dtype="float32"), mesh)
    alone = {k: v for k, v in spec.items() if k != "rope_parameters"}
    with pytest.raises(ConfigError, match=r"^model_config\.rope_theta: must be a number, got "
                                          r"'1e6'"):
        ff.shard_model(ff.EngineConfig(model_config={**alone, "rope_theta": "1e6"},
                                       dtype="float32"), mesh)
    # the base given alone, or the same base twice, is the model's
    for given in ({**alone, "rope_theta": 1e6}, {**spec, "rope_theta": 10000.0}):
        state = ff.shard_model(ff.EngineConfig(model_config=given, dtype="float32",
                                               optimizer=None), mesh)
        assert state.hf_config.rope_parameters["rope_theta"] == given["rope_theta"]


def test_a_model_directorys_config_with_a_size_below_one_is_a_config_error(tmp_path):
    """The same check on a model_path's config.json: its field, the file, the rule."""
    import json

    mesh = ff.build_mesh(ff.ParallelStrategy(), device_type="cpu")
    spec = {**tiny_qwen2_config().to_dict(), "num_attention_heads": 0}
    (tmp_path / "config.json").write_text(json.dumps(spec))
    with pytest.raises(ConfigError, match=r"^model_path: num_attention_heads in '.*config\.json' "
                                          r"must be an int >= 1 .*got 0$"):
        ff.shard_model(ff.EngineConfig(model_path=str(tmp_path), dtype="float32"), mesh)
