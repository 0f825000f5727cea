"""LoRA in one process: config validation, names, the merge against a float64 reference, and the
built-in server's SGLang-shaped /load_lora_adapter and /unload_lora_adapter on a RolloutEngine."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fsdpfn as ff
from fsdpfn.engine import lora
from fsdpfn import serde
from fsdpfn.errors import ConfigError
from fsdpfn.app.recipes.config import DPORecipe, GRPORecipe, SFTRecipe
from fsdpfn.testing import save_tiny_model, tiny_qwen2_config


# ---------------------------------------------------------------- config


def test_lora_config_defaults_to_all_linear_and_accepts_a_string():
    assert ff.LoRAConfig().target_modules == ("all-linear",)
    assert ff.LoRAConfig(target_modules="all-linear").target_modules == ("all-linear",)
    assert ff.LoRAConfig(target_modules=["q_proj", "v_proj"]).target_modules == ("q_proj",
                                                                                 "v_proj")


@pytest.mark.parametrize("kwargs, field", [
    ({"rank": 0}, "rank"), ({"alpha": 0}, "alpha"), ({"dropout": 1.0}, "dropout"),
    ({"target_modules": []}, "target_modules"),
    ({"target_modules": ["all-linear", "q_proj"]}, "target_modules"),
])
def test_lora_config_errors_name_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=f"^{field}: "):
        ff.LoRAConfig(**kwargs)


def test_engine_config_refuses_lora_on_a_critic():
    with pytest.raises(ConfigError, match="^lora: .*critic"):
        ff.EngineConfig(model_path="x", is_critic=True, lora=ff.LoRAConfig())


@pytest.mark.parametrize("cls, name", [(GRPORecipe, "grpo"), (SFTRecipe, "sft"),
                                       (DPORecipe, "dpo")])
def test_recipes_accept_lora_in_yaml(cls, name):
    cfg = serde.from_yaml(f"recipe: {name}\nengine:\n  lora:\n    rank: 16\n    alpha: 32\n"
                          f"    target_modules: [q_proj, v_proj]\n", cls)
    assert cfg.engine.lora == ff.LoRAConfig(rank=16, alpha=32.0,
                                            target_modules=("q_proj", "v_proj"))
    assert serde.from_yaml(serde.to_yaml(cfg), cls) == cfg
    assert serde.from_yaml(f"recipe: {name}\n", cls).engine.lora is None


def test_yaml_string_target_modules_is_one_name_not_its_characters():
    cfg = serde.from_yaml("recipe: grpo\nengine:\n  lora:\n    target_modules: all-linear\n",
                          GRPORecipe)
    assert cfg.engine.lora.target_modules == ("all-linear",)
    with pytest.raises(ConfigError,
                       match="engine.lora.target_modules: 'all-linear' must stand alone"):
        serde.from_yaml("recipe: grpo\nengine:\n  lora:\n    target_modules: [all-linear, "
                        "q_proj]\n", GRPORecipe)
    cfg = serde.from_yaml("recipe: grpo\nengine:\n  lora:\n    target_modules: q_proj\n",
                          GRPORecipe)
    assert cfg.engine.lora.target_modules == ("q_proj",)


def test_a_list_of_one_names_characters_is_refused_in_words_that_match_yaml():
    """A string is one name (above); what the rule refuses is a list of characters (Python's
    list('q_proj')), and its words, which docs/recipes.md shows, say so."""
    with pytest.raises(ConfigError) as info:
        ff.LoRAConfig(target_modules=list("q_proj"))
    assert str(info.value) == ("target_modules: must be a list of module names, not one name's "
                               "characters (one name alone is that name: q_proj or [q_proj, "
                               "v_proj]), got ['q', '_', 'p', 'r', 'o', 'j']")
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "recipes.md").read_text()
    row = next(line for line in page.splitlines() if "`engine.lora.target_modules`" in line)
    assert "reads as its characters" not in row and "one name alone is that name" in row


def test_target_names_all_linear_and_unknown_names():
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(tiny_qwen2_config())
    assert lora.target_names(lm, ff.LoRAConfig()) == [
        "down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    with pytest.raises(ConfigError, match="lora.target_modules: .*'lm_head'"):
        lora.target_names(lm, ff.LoRAConfig(target_modules=("lm_head",)))


# ---------------------------------------------------------------- names and the merge


def test_names_between_engine_hf_and_peft():
    name = "lm.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    assert lora.is_adapter(name) and not lora.is_adapter("lm.model.norm.weight")
    assert lora.peft_key(name) == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert lora.hf_name("lm.model.layers.0.mlp.up_proj.base_layer.bias") == \
        "lm.model.layers.0.mlp.up_proj.bias"


@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(out=st.integers(1, 6), inp=st.integers(1, 6), r=st.integers(1, 4),
       alpha=st.floats(0.5, 64.0), seed=st.integers(0, 1000))
def test_merge_full_state_equals_float64_reference(out, inp, r, alpha, seed):
    g = torch.Generator().manual_seed(seed)
    w, bias = torch.randn(out, inp, generator=g), torch.randn(out, generator=g)
    a, b = torch.randn(r, inp, generator=g), torch.randn(out, r, generator=g)
    m = "lm.model.layers.0.mlp.up_proj"
    full = {f"{m}.base_layer.weight": w, f"{m}.base_layer.bias": bias,
            f"{m}.lora_A.default.weight": a, f"{m}.lora_B.default.weight": b,
            "lm.model.norm.weight": torch.ones(3)}
    cfg = ff.LoRAConfig(rank=r, alpha=alpha)
    merged = lora.merge_full_state(full, cfg)
    assert sorted(merged) == sorted([f"{m}.weight", f"{m}.bias", "lm.model.norm.weight"])
    want = w.double() + (alpha / r) * (b.double() @ a.double())
    torch.testing.assert_close(merged[f"{m}.weight"].double(), want, atol=1e-4, rtol=1e-5)
    # the same through MergedWeight (the push path), and the inputs are left as they were
    before = w.clone()
    pushed = lora.MergedWeight(w, a, b, alpha / r).full(torch.float64, "cpu")
    torch.testing.assert_close(pushed, want, atol=1e-4, rtol=1e-5)
    assert torch.equal(w, before)


# ---------------------------------------------------------------- the built-in server


@pytest.fixture(scope="module")
def engine_and_dir(tmp_path_factory):
    from fsdpfn.rollout.engine import RolloutEngine

    root = tmp_path_factory.mktemp("lora_unit")
    model_dir = save_tiny_model(root / "tiny", tiny_qwen2_config(), seed=0)
    return RolloutEngine(str(model_dir)), root


def _adapter_dir(root, name: str, *, seed: int, r: int = 2, alpha: float = 4.0,
                 modules=("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj")):
    from safetensors.torch import save_file

    shapes = {"q_proj": (64, 64), "down_proj": (64, 128)}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for m in modules:
        out, inp = shapes[m.rsplit(".", 1)[-1]]
        tensors[f"base_model.model.{m}.lora_A.weight"] = torch.randn(r, inp, generator=g)
        tensors[f"base_model.model.{m}.lora_B.weight"] = torch.randn(out, r, generator=g)
    path = root / name
    path.mkdir()
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": r, "lora_alpha": alpha,
         "target_modules": sorted({m.rsplit(".", 1)[-1] for m in modules})}))
    return path, tensors


def test_engine_merges_replaces_and_unloads_adapters(engine_and_dir):
    engine, root = engine_and_dir
    q = "model.layers.0.self_attn.q_proj.weight"
    down = "model.layers.1.mlp.down_proj.weight"
    base = {n: engine.params[n].data.clone() for n in (q, down)}
    one, t1 = _adapter_dir(root, "one", seed=1)
    # SGLang's LoadLoRAAdapterReqInput fields, as its client sends them
    answer = engine.receiver.load_lora_adapter({"lora_name": "p", "lora_path": str(one), "pinned": False,
                                       "lora_id": None, "weight_version": 7})
    assert answer["success"] and answer["loaded_adapters"] == {"p": str(one)}
    assert engine.version == 7
    a = t1["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].double()
    b = t1["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"].double()
    torch.testing.assert_close(engine.params[q].data.double(), base[q].double() + 2.0 * b @ a,
                               atol=1e-5, rtol=1e-5)
    # a second adapter merges into the base (not into the first merge); down_proj is restored
    two, t2 = _adapter_dir(root, "two", seed=2, modules=("model.layers.0.self_attn.q_proj",))
    engine.receiver.load_lora_adapter({"lora_name": "p", "lora_path": str(two)})
    assert engine.version == 8
    a = t2["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].double()
    b = t2["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"].double()
    torch.testing.assert_close(engine.params[q].data.double(), base[q].double() + 2.0 * b @ a,
                               atol=1e-5, rtol=1e-5)
    assert torch.equal(engine.params[down].data, base[down])
    answer = engine.receiver.unload_lora_adapter({"lora_name": "p"})
    assert answer["loaded_adapters"] == {} and torch.equal(engine.params[q].data, base[q])


def test_engine_refuses_a_bad_adapter_and_keeps_its_weights(engine_and_dir):
    from fsdpfn.rollout.engine import UpdateError

    engine, root = engine_and_dir
    version, checksum = engine.version, engine.weights_checksum()
    bad, _ = _adapter_dir(root, "bad", seed=3, modules=("model.layers.0.self_attn.q_proj",))
    (bad / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2,
                                                         "lora_alpha": 4}))
    from safetensors.torch import save_file

    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight":
               torch.zeros(2, 5),  # the rank is right; A's 5 columns are not q_proj's 64
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight":
               torch.zeros(64, 2)}, str(bad / "adapter_model.safetensors"))
    with pytest.raises(UpdateError, match="B @ A must have the weight's shape"):
        engine.receiver.load_lora_adapter({"lora_name": "p", "lora_path": str(bad)})
    with pytest.raises(UpdateError, match="lora_path: must be a peft adapter directory"):
        engine.receiver.load_lora_adapter({"lora_name": "p", "lora_path": str(root / "missing")})
    with pytest.raises(UpdateError, match="lora_name: must name the loaded adapter"):
        engine.receiver.unload_lora_adapter({"lora_name": "nothing"})
    assert engine.version == version and engine.weights_checksum() == checksum


# ---------------------------------------------------------------- what the server reads from peft


@pytest.fixture()
def fresh_engine(tmp_path):
    from fsdpfn.rollout.engine import RolloutEngine

    model_dir = save_tiny_model(tmp_path / "tiny", tiny_qwen2_config(), seed=0)
    return RolloutEngine(str(model_dir)), tmp_path


def test_rank_and_alpha_patterns_and_rslora_scale_each_module_as_peft_does(fresh_engine):
    """peft's rank_pattern/alpha_pattern give a module its own r and alpha (the first pattern
    matching the module path whole or as its tail); use_rslora divides by sqrt(r). Checked
    against the float64 merge with each module's scale worked out here."""
    engine, root = fresh_engine
    q = "model.layers.0.self_attn.q_proj"
    down = "model.layers.1.mlp.down_proj"
    base = {m: engine.params[f"{m}.weight"].data.double().clone() for m in (q, down)}
    g = torch.Generator().manual_seed(5)
    ranks = {q: 3, down: 2}  # q_proj from rank_pattern, down_proj the default r
    tensors = {}
    for m, r in ranks.items():
        out, inp = base[m].shape
        tensors[f"base_model.model.{m}.lora_A.weight"] = torch.randn(r, inp, generator=g)
        tensors[f"base_model.model.{m}.lora_B.weight"] = torch.randn(out, r, generator=g)
    from safetensors.torch import save_file

    for rslora in (False, True):
        path = root / f"patterns_{rslora}"
        path.mkdir()
        save_file(tensors, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps(
            {"peft_type": "LORA", "r": 2, "lora_alpha": 4.0, "use_rslora": rslora,
             "rank_pattern": {"q_proj": 3}, "alpha_pattern": {"layers.1.mlp.down_proj": 32},
             "target_modules": ["q_proj", "down_proj"]}))
        engine.receiver.load_lora_adapter({"lora_name": "p", "lora_path": str(path)})
        for m, alpha in ((q, 4.0), (down, 32.0)):
            r = ranks[m]
            scale = alpha / (r ** 0.5 if rslora else r)
            a = tensors[f"base_model.model.{m}.lora_A.weight"].double()
            b = tensors[f"base_model.model.{m}.lora_B.weight"].double()
            torch.testing.assert_close(engine.params[f"{m}.weight"].data.double(),
                                       base[m] + scale * b @ a, atol=1e-5, rtol=1e-5)


def _write_adapter(path, tensors: dict, config) -> None:
    from safetensors.torch import save_file

    path.mkdir()
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(config if isinstance(config, str)
                                               else json.dumps(config))


_Q = "base_model.model.model.layers.0.self_attn.q_proj"
_GOOD = {f"{_Q}.lora_A.weight": torch.ones(2, 64), f"{_Q}.lora_B.weight": torch.ones(64, 2)}
_CONFIG = {"peft_type": "LORA", "r": 2, "lora_alpha": 4.0, "target_modules": ["q_proj"]}


@pytest.mark.parametrize("tensors, config, words", [
    (_GOOD, {**_CONFIG, "r": 4}, "lora_A must have r=4 rows"),
    (_GOOD, {**_CONFIG, "rank_pattern": {"q_proj": 3}}, "r=3"),
    (_GOOD, {**_CONFIG, "lora_alpha": float("nan")}, "lora_alpha: must be a finite number"),
    (_GOOD, {**_CONFIG, "alpha_pattern": {"q_proj": "big"}}, "alpha_pattern['q_proj']"),
    (_GOOD, {**_CONFIG, "fan_in_fan_out": True}, "fan_in_fan_out: must be unset or false"),
    (_GOOD, {**_CONFIG, "use_dora": True}, "use_dora: must be unset or false"),
    (_GOOD, {**_CONFIG, "alora_invocation_tokens": [1, 2]}, "alora_invocation_tokens"),
    (_GOOD, '{"r": 2, lora_alpha: 4}', "must be a JSON object, got unreadable JSON"),
    (_GOOD, '[1, 2]', "must be a JSON object, got a list"),
    ({k: v.to(torch.int32) for k, v in _GOOD.items()}, _CONFIG, "floating-point matrix"),
    ({"base_model.model.model.norm.lora_A.weight": torch.ones(2),
      "base_model.model.model.norm.lora_B.weight": torch.ones(64, 2)}, _CONFIG,
     "floating-point matrix"),
    ({"base_model.model.model.embed_tokens.lora_A.weight": torch.ones(2, 64),
      "base_model.model.model.embed_tokens.lora_B.weight": torch.ones(128, 2)}, _CONFIG,
     "must be a linear layer of the served model, got Embedding"),
])
def test_an_adapter_peft_would_not_compute_so_is_a_400_and_the_weights_stay(
        fresh_engine, tensors, config, words):
    from fsdpfn.rollout.engine import UpdateError

    engine, root = fresh_engine
    good = root / "good"
    _write_adapter(good, _GOOD, _CONFIG)
    engine.receiver.load_lora_adapter({"lora_name": "p", "lora_path": str(good)})
    version, checksum = engine.version, engine.weights_checksum()
    bad = root / "bad"
    _write_adapter(bad, tensors, config)
    with pytest.raises(UpdateError) as info:
        engine.receiver.load_lora_adapter({"lora_name": "p", "lora_path": str(bad)})
    assert words in str(info.value) and info.value.status == 400, str(info.value)
    assert (engine.version, engine.weights_checksum()) == (version, checksum)
    assert engine.receiver.adapter.path == str(good)


def test_a_corrupt_safetensors_file_is_a_400_naming_the_file(fresh_engine):
    from fsdpfn.rollout.engine import UpdateError

    engine, root = fresh_engine
    path = root / "corrupt"
    _write_adapter(path, _GOOD, _CONFIG)
    (path / "adapter_model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(UpdateError, match="adapter_model.safetensors' must be a safetensors "
                                          "file") as info:
        engine.receiver.load_lora_adapter({"lora_name": "p", "lora_path": str(path)})
    assert info.value.status == 400


def _save_weights(engine, path, scale: float = 1.0):
    """The engine's own weights (times ``scale``) as a safetensors directory: a whole update."""
    from safetensors.torch import save_file

    path.mkdir()
    save_file({n: (t.data * scale).contiguous() for n, t in engine.params.items()},
              str(path / "model.safetensors"))


def test_weight_updates_replace_the_base_under_an_adapter(fresh_engine):
    """A partial update (SGLang's per-bucket requests) drops the adapter from the weights it
    sends, and unloading leaves them as sent; a whole update of a LoRA trainer's merged
    weights refuses an adapter on top (it would count them twice) until plain weights come."""
    engine, root = fresh_engine
    q = "model.layers.0.self_attn.q_proj.weight"
    down = "model.layers.1.mlp.down_proj.weight"
    two, _ = _adapter_dir(root, "two_modules", seed=4)
    engine.receiver.load_lora_adapter({"lora_name": "p", "lora_path": str(two)})
    down_base = engine.receiver.adapter.base[down].clone()
    new_q = torch.full_like(engine.params[q].data, 0.5)
    engine.receiver._swap({q: new_q}, engine.version + 1, None, whole=False)
    assert torch.equal(engine.params[q].data, new_q)
    engine.receiver.unload_lora_adapter({"lora_name": "p"})
    assert torch.equal(engine.params[q].data, new_q)  # as sent, not the old base
    assert torch.equal(engine.params[down].data, down_base)

    merged = root / "merged"
    _save_weights(engine, merged, scale=1.01)
    engine.receiver.update_from_disk({"model_path": str(merged), "merged_adapters": True})
    from fsdpfn.rollout.engine import UpdateError

    version, checksum = engine.version, engine.weights_checksum()
    with pytest.raises(UpdateError, match="count them twice") as info:
        engine.receiver.load_lora_adapter({"lora_name": "p", "lora_path": str(two)})
    assert info.value.status == 400
    assert (engine.version, engine.weights_checksum()) == (version, checksum)
    plain = root / "plain"
    _save_weights(engine, plain)
    engine.receiver.update_from_disk({"model_path": str(plain)})
    engine.receiver.load_lora_adapter({"lora_name": "p", "lora_path": str(two)})
    assert engine.receiver.adapter is not None


def test_lora_config_target_modules_null_is_the_default():
    assert ff.LoRAConfig(target_modules=None).target_modules == ("all-linear",)
    assert serde.structure({"target_modules": None}, ff.LoRAConfig).target_modules == \
        ("all-linear",)
