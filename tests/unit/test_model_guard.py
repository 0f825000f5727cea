"""What the engine cannot compute exactly is refused by name; what it does not know is checked.

- shard_model refuses mixture-of-experts, encoder-decoder, multimodal and logit-scaling models
  with a ConfigError naming the model_type and the reason.
- The guard (EngineConfig.verify_model) refuses an unlisted architecture whose attention applies
  an option the packed attention ignores (a logit scale passed to its attention function), with
  the measured gap; a correct unlisted architecture builds and equals its own forward.
"""

from __future__ import annotations

import logging

import pytest
import torch

import fsdpfn as ff
from fsdpfn import keys as K
from fsdpfn.errors import ConfigError
from fsdpfn.engine.families import VERIFIED, verify_architecture
from fsdpfn.testing.models import (REFERENCE_STEP, _common, exact_here, hf_config_of,
                                   hf_reference_logp)


def assert_equals_its_own_forward(state, model) -> None:
    """forward_logp of ``state`` equals ``model``'s own forward to 1e-5 on three random rows."""
    batch = ff.testing.random_batch(3, 30, vocab_size=131, seed=2, min_len=10)
    with torch.no_grad():
        ref, _ = hf_reference_logp(model, batch[K.INPUT_IDS], batch[K.ATTENTION_MASK])
    got = ff.forward_logp(state, batch)[K.LOGP]
    assert float((got - ref).abs().max()) <= 1e-5


def _build(spec: dict, **kwargs):
    mesh = ff.build_mesh(ff.ParallelStrategy(), device_type="cpu")
    cfg = ff.EngineConfig(model_config=spec, dtype="float32", optimizer=None, **kwargs)
    return ff.shard_model(cfg, mesh)


@pytest.mark.parametrize("spec,reason", [
    (dict(model_type="mixtral", num_local_experts=4), "mixture-of-experts"),
    (dict(model_type="qwen2_moe", num_experts=4), "mixture-of-experts"),
    (dict(model_type="llama", num_experts=2), "mixture-of-experts"),
    (dict(model_type="t5"), "encoder-decoder"),
    (dict(model_type="gemma3"), "multimodal"),
    (dict(model_type="cohere", logit_scale=0.25), "logit_scale"),
    (dict(model_type="falcon", alibi=True), "ALiBi"),
    (dict(model_type="mpt"), "ALiBi"),
    (dict(model_type="mamba2"), "recurrent or state-space"),
    (dict(model_type="bamba"), "recurrent or state-space"),
    (dict(model_type="recurrent_gemma"), "recurrent or state-space"),
    (dict(model_type="lfm2", layer_types=["conv", "full_attention"], num_hidden_layers=2),
     "layers that are not attention (layer types ['conv'])"),
], ids=["mixtral", "qwen2_moe", "llama-with-experts", "t5", "gemma3-multimodal", "cohere",
        "falcon-alibi", "mpt", "mamba2", "bamba", "recurrent_gemma", "lfm2-conv"])
def test_unsupported_models_are_refused_by_model_type_and_reason(spec, reason):
    """Each names its reason (ALiBi and recurrent families were refused with an internal error
    of the architecture probe as their reason: an AttributeError, an invalid small config)."""
    model_type = spec["model_type"]
    if model_type in ("t5", "gemma3", "mpt", "mamba2", "bamba", "recurrent_gemma"):
        spec = dict(spec)
    else:
        spec = _common({"vocab_size": 131, **spec})
    with pytest.raises(ConfigError) as err:
        _build(spec)
    assert repr(model_type) in str(err.value) and reason in str(err.value)
    assert "verified families" in str(err.value)


# ---------------------------------------------------------------- unlisted architectures


def _register_scaled_family(model_type: str, logit_scale: float):
    """A Llama whose attention passes ``logit_scale`` to its attention function (its eager
    function applies it; the engine's packed attention does not know the option)."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama import modeling_llama as ml

    def scaled_eager(module, query, key, value, attention_mask, scaling=None, logit_scale=1.0,
                     **kwargs):
        return ml.eager_attention_forward(module, query, key, value, attention_mask,
                                          scaling=scaling * logit_scale, **kwargs)

    class ScaledAttention(ml.LlamaAttention):
        def forward(self, hidden_states, position_embeddings=None, attention_mask=None,
                    **kwargs):
            shape = (*hidden_states.shape[:-1], -1, self.head_dim)
            q, k, v = (p(hidden_states).view(shape).transpose(1, 2)
                       for p in (self.q_proj, self.k_proj, self.v_proj))
            q, k = ml.apply_rotary_pos_emb(q, k, *position_embeddings)
            name = self.config._attn_implementation  # eager: the scaled function itself
            attend = scaled_eager if name == "eager" else ALL_ATTENTION_FUNCTIONS[name]
            out, weights = attend(self, q, k, v, attention_mask, scaling=self.scaling,
                                  dropout=0.0, logit_scale=logit_scale, **kwargs)
            return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1)), weights

    config_cls = type(f"{model_type}Config", (LlamaConfig,), {"model_type": model_type})

    class ScaledForCausalLM(LlamaForCausalLM):
        config_class = config_cls

        def __init__(self, config):
            super().__init__(config)
            for layer in self.model.layers:
                layer.self_attn.__class__ = ScaledAttention

    AutoConfig.register(model_type, config_cls, exist_ok=True)
    AutoModelForCausalLM.register(config_cls, ScaledForCausalLM, exist_ok=True)
    return _common({"model_type": model_type, "vocab_size": 131})


def test_guard_refuses_an_unlisted_architecture_the_packed_path_computes_wrongly():
    spec = _register_scaled_family("fsdpfn_test_scaled", logit_scale=3.0)
    with pytest.raises(ConfigError) as err:
        _build(spec)
    message = str(err.value)
    assert "'fsdpfn_test_scaled'" in message and "differs from the model's own forward" in message
    assert all(name in message for name in VERIFIED)
    gap = float(message.split("forward by ")[1].split(" ")[0])
    assert gap > 1e-3
    # the user may take the risk: the same model builds with the guard off
    assert _build(spec, verify_model="never").model is not None


def test_a_family_with_an_integer_buffer_outside_its_checkpoint_is_probed():
    """OpenAI GPT keeps an int64 ``position_ids`` buffer outside its checkpoint: filling it
    with NaN to detect what HF's init leaves unset overflowed, and the model was refused with
    that overflow as its reason. The buffer is now restored and the probe measures the model:
    its attention ignores the packed rows' bounds, and the refusal says so by its gap."""
    spec = dict(model_type="openai-gpt", vocab_size=96, n_embd=32, n_layer=2, n_head=4,
                n_positions=64)
    with pytest.raises(ConfigError, match=r"^model_type: 'openai-gpt' is not computed exactly "
                                          r"by the engine: its packed forward differs"):
        _build(spec)


def test_guard_lets_a_correct_unlisted_architecture_run_and_says_so(caplog):
    spec = _register_scaled_family("fsdpfn_test_plain", logit_scale=1.0)
    with caplog.at_level(logging.INFO, logger="fsdpfn"):
        state = _build(spec)
    assert any("'fsdpfn_test_plain'" in r.getMessage() and "checked" in r.getMessage()
               for r in caplog.records)
    # and it is right: forward_logp equals the model's own forward with the state's weights
    assert_equals_its_own_forward(state, _own_model(state, spec))


def _own_model(state, spec: dict):
    """The HF model of ``spec`` with the state's weights, on HF's eager attention."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import AutoModelForCausalLM

    sd = get_model_state_dict(state.model, options=StateDictOptions(full_state_dict=True))
    config = hf_config_of(spec)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict({k[len("lm."):]: v for k, v in sd.items()})
    return model


@pytest.mark.parametrize("spec", [
    # every CWM checkpoint's token ids (past the probe's vocabulary; CwmConfig refuses None)
    dict(model_type="cwm", bos_token_id=128000, eos_token_id=[128001, 128008], head_dim=16,
         sliding_window=8, num_hidden_layers=3,
         layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    # more layers than the probe keeps, with per_layer_config entries of layers past them
    dict(model_type="gemma4_text", num_hidden_layers=12, head_dim=16, global_head_dim=32,
         sliding_window=8, hidden_size_per_layer_input=16, vocab_size_per_layer_input=131),
], ids=["cwm-checkpoint-token-ids", "gemma4-12-layers"])
def test_guard_probes_real_sized_configs_of_accepted_families(spec):
    """The guard's small config keeps what transformers validates: token ids within its
    vocabulary and per-layer tables cut to the layers it keeps (both families were refused
    as 'could not be checked' though the engine computes them exactly)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if spec["model_type"] not in CONFIG_MAPPING:
        pytest.skip(f"{spec['model_type']} is not in this transformers")
    spec = _common({**spec, "vocab_size": 131})
    state = _build(spec)  # verify_model="unverified": both go through the guard
    assert_equals_its_own_forward(state, _own_model(state, spec))


def test_guard_runs_on_verified_families_when_asked_always(caplog):
    spec = _common({"model_type": "qwen2", "vocab_size": 131})
    with caplog.at_level(logging.INFO, logger="fsdpfn"):
        _build(spec, verify_model="always")
    assert any("checked" in r.getMessage() for r in caplog.records)


def test_verify_model_rejects_unknown_values():
    with pytest.raises(ConfigError, match="verify_model"):
        ff.EngineConfig(model_config={"model_type": "llama"}, verify_model="sometimes")


def test_guard_probe_measures_exactly_the_gap_of_the_scaled_attention():
    # independent of shard_model: the architecture check itself, with and without the defect
    assert verify_architecture(hf_config_of(_register_scaled_family("fsdpfn_test_plain",
                                                                      1.0))) < 1e-5
    assert verify_architecture(hf_config_of(_register_scaled_family("fsdpfn_test_scaled",
                                                                      3.0))) > 1e-3


@pytest.mark.parametrize("kwargs,field", [(dict(is_critic=True), "is_critic"),
                                          (dict(lora=ff.LoRAConfig()), "lora")])
def test_what_the_engine_reads_by_name_is_refused_when_the_family_names_it_otherwise(kwargs,
                                                                                      field):
    # GPT-NeoX: its token-classification head is 'classifier', its layers 'gpt_neox.layers'
    with pytest.raises(ConfigError) as err:
        _build(_common({"model_type": "gpt_neox", "vocab_size": 131}), **kwargs)
    assert str(err.value).startswith(f"{field}:") and "'gpt_neox'" in str(err.value)


def test_guard_checks_a_critic_against_its_own_token_classification_forward(caplog):
    spec = _common({"model_type": "qwen2", "vocab_size": 131})
    with caplog.at_level(logging.INFO, logger="fsdpfn"):
        _build(spec, is_critic=True, verify_model="always")
    assert any("checked" in r.getMessage() for r in caplog.records)
    config = hf_config_of(spec)
    config.num_labels = 1
    assert verify_architecture(config, is_critic=True) < 1e-5


def test_guard_leaves_the_callers_random_state_as_it_was():
    config = hf_config_of(_common({"model_type": "qwen2", "vocab_size": 131}))
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    verify_architecture(config)
    assert torch.equal(torch.rand(3), expected)


def test_a_checkpoint_whose_names_transformers_renames_on_load_loads_and_equals_its_forward(
        tmp_path):
    # GPT-NeoX (Pythia) checkpoints name the head 'embed_out'; transformers 5 builds the module
    # as 'lm_head' and renames on load. The engine reads the checkpoint's own file, so it must
    # find the head under the checkpoint's name, and compute the same log-probs as the model
    # transformers loads from the same directory.
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    spec = _common({"model_type": "gpt_neox", "vocab_size": 131, "rotary_pct": 0.25})
    config = hf_config_of(spec)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    head = model.get_output_embeddings().weight
    head_key = next(n for n, m in model.named_modules() if m is model.get_output_embeddings())
    tensors = {("embed_out.weight" if k == f"{head_key}.weight" else k): v.contiguous()
               for k, v in model.state_dict().items()}
    assert "embed_out.weight" in tensors and "lm_head.weight" not in tensors
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(tmp_path)

    mesh = ff.build_mesh(ff.ParallelStrategy(), device_type="cpu")
    state = ff.shard_model(ff.EngineConfig(model_path=str(tmp_path), dtype="float32",
                                           optimizer=None), mesh)
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32,
                                                     attn_implementation="eager")
    assert torch.equal(reference.get_output_embeddings().weight, head)  # it read embed_out
    assert_equals_its_own_forward(state, reference)


def test_export_writes_the_names_save_pretrained_writes(tmp_path):
    # the export of a family whose module names differ from its checkpoint names (GPT-NeoX)
    # carries the checkpoint's names, as transformers' own save_pretrained does, and reloads
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    spec = _common({"model_type": "gpt_neox", "vocab_size": 131})
    state = _build(spec)
    ff.export_hf(state, str(tmp_path / "ours"))
    reloaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "ours"), dtype=torch.float32,
                                                    attn_implementation="eager")
    # what transformers writes for a model of this config it built itself
    AutoModelForCausalLM.from_config(hf_config_of(spec)).save_pretrained(str(tmp_path / "theirs"))

    def names(path):
        with safe_open(str(path / "model.safetensors"), framework="pt") as f:
            return sorted(f.keys())

    assert names(tmp_path / "ours") == names(tmp_path / "theirs")
    assert_equals_its_own_forward(state, reloaded)


# ---------------------------------------------------------------- layers that drop the keywords

LAYERS_DROP_KEYWORDS = {  # decoder layers that call their attention without the pack's keywords
    "stablelm": dict(model_type="stablelm", pad_token_id=0),
    "stablelm-qk-norm-parallel": dict(model_type="stablelm", qk_layernorm=True, pad_token_id=0,
                                      use_parallel_residual=True, use_qkv_bias=True),
    "nemotron": dict(model_type="nemotron"),
    # Falcon's model does not pass them to its layers either
    "falcon-7b": dict(model_type="falcon", multi_query=True, parallel_attn=True),
    "falcon-40b": dict(model_type="falcon", new_decoder_architecture=True, num_kv_heads=2),
}
OPT = REFERENCE_STEP  # the step hf_reference_update computes


@pytest.mark.parametrize("checkpointing", [False, True], ids=["eager", "checkpointing"])
@pytest.mark.parametrize("family", sorted(LAYERS_DROP_KEYWORDS))
def test_a_family_whose_layers_drop_the_packed_keywords_is_computed_exactly(family, checkpointing,
                                                                           tmp_path, caplog):
    # StableLM's and Nemotron's decoder layers call their attention without the keywords they
    # are handed (cu_seq_lens_q ...), and Falcon's model calls its layers without them. The
    # engine keeps the pack's keywords for the stack's call, so the packed rows stay apart; with
    # activation checkpointing the recomputation in the backward needs them again. Log-probs,
    # loss and update equal the model's own eager float32 ones. On a transformers release before
    # the family computes exactly on a pack (EXACT_SINCE), it is refused by name instead.
    from fsdpfn.testing.models import (assert_update_matches, engine_update,
                                       hf_reference_update, save_family_model)

    spec = _common({"vocab_size": 131, **LAYERS_DROP_KEYWORDS[family]})
    path = str(save_family_model(tmp_path / family, spec, seed=4))
    mesh = ff.build_mesh(ff.ParallelStrategy(), device_type="cpu")
    config = ff.EngineConfig(model_path=path, dtype="float32",
                             optimizer=ff.OptimizerConfig(**OPT),
                             gradient_checkpointing=checkpointing)
    if not exact_here(spec["model_type"]):  # an older transformers: refused by name
        with pytest.raises(ConfigError, match=repr(spec["model_type"])):
            ff.shard_model(config, mesh)
        return
    with caplog.at_level(logging.INFO, logger="fsdpfn"):
        state = ff.shard_model(config, mesh)
    assert spec["model_type"] not in VERIFIED
    assert any("checked" in r.getMessage() and spec["model_type"] in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]
    batch = ff.testing.random_batch(3, 40, vocab_size=131, seed=0, min_len=20, prompt_len=3)
    assert_update_matches(f"{family} checkpointing={checkpointing}",
                          engine_update(state, batch, mesh), hf_reference_update(path, batch))
