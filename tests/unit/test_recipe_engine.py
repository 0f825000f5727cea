"""The recipes' engine: section (EngineConfig in YAML), its refusals, preflight and the memory
estimate (against numbers derived by hand in the comments)."""

from __future__ import annotations

import json

import attrs
import pytest

import fsdpfn as ff
from fsdpfn import serde
from fsdpfn.errors import ConfigError
from fsdpfn.app.recipes import RECIPE_CONFIGS, default_config
from fsdpfn.app.recipes.engine import OWNED, EngineSection, build_engine, engines
from fsdpfn.app.recipes import memory, preflight
from fsdpfn.app.recipes.memory import (GiB, HEADROOM, ModelShape, check_disk, check_host_memory,
                                       check_memory, checkpoint_bytes, estimate_memory,
                                       host_bytes, run_estimate)
from fsdpfn.app.recipes.preflight import check_data, check_positions, check_reward

FILES = ["model.path=/models/x", "data.train_files=[train.jsonl]"]


# ---------------------------------------------------------------- the YAML mapping


def test_engine_section_has_every_engine_config_field_but_the_owned_ones():
    names = {a.name for a in attrs.fields(ff.EngineConfig)}
    assert {a.name for a in attrs.fields(EngineSection)} == names - set(OWNED)
    assert set(OWNED) <= names


@pytest.mark.parametrize("recipe", sorted(RECIPE_CONFIGS))
def test_default_budget_is_the_engines_automatic_one(recipe):
    cfg = default_config(recipe)
    for section in engines(cfg).values():
        assert section.mb_spec == ff.MicroBatchSpec()  # max_tokens_per_mb=None
        assert section.mb_spec.max_tokens_per_mb is None


def test_every_engine_option_reaches_the_engine_config_and_config_yaml():
    text = """recipe: grpo
engine:
  dtype: bfloat16
  grad_reduce_dtype: bfloat16
  optimizer_dtype: bfloat16
  gradient_checkpointing: true
  disable_dropout: false
  logprobs_chunk_size: 256
  mb_spec: {max_tokens_per_mb: 4096, n_mbs: 2, algo: kk}
  fsdp: {wrap_policy: [Qwen2DecoderLayer], reshard_after_forward: false,
         memory_efficient_load: false, per_layer_optim_step: true,
         optim_step_prefetch_layers: 2}
  lora: {rank: 4, alpha: 8, target_modules: [q_proj]}
  attn_impl: sdpa
  fused_kernels: false
  logprobs_impl: liger
  timing: false
  peak_tflops: 100
"""
    cfg = serde.from_yaml(text, RECIPE_CONFIGS["grpo"])
    assert serde.from_yaml(serde.to_yaml(cfg), RECIPE_CONFIGS["grpo"]) == cfg  # config.yaml
    opt = ff.OptimizerConfig(lr=0.5)
    engine = build_engine(cfg.engine, model_path="/m", device="cpu", optimizer=opt, seed=7)
    expected = ff.EngineConfig(
        model_path="/m", dtype="bfloat16", grad_reduce_dtype="bfloat16",
        optimizer_dtype="bfloat16", gradient_checkpointing=True, disable_dropout=False,
        logprobs_chunk_size=256, mb_spec=ff.MicroBatchSpec(4096, 2, "kk"),
        fsdp=ff.FSDPConfig(wrap_policy=("Qwen2DecoderLayer",), reshard_after_forward=False,
                           memory_efficient_load=False, per_layer_optim_step=True,
                           optim_step_prefetch_layers=2),
        lora=ff.LoRAConfig(rank=4, alpha=8.0, target_modules=("q_proj",)), attn_impl="sdpa",
        fused_kernels=False, logprobs_impl="liger", timing=False, peak_tflops=100.0,
        optimizer=opt, seed=7)
    assert engine == expected


def test_auto_dtype_follows_the_device():
    cfg = default_config("sft")
    assert build_engine(cfg.engine, model_path="m", device="cpu", optimizer=None,
                        seed=0).dtype == "float32"
    assert build_engine(cfg.engine, model_path="m", device="cuda", optimizer=None,
                        seed=0).dtype == "bfloat16"


def test_critic_and_ref_sections_override_the_policys_fields():
    cfg = default_config("ppo", ["engine.gradient_checkpointing=true",
                                 "engine.fsdp.per_layer_optim_step=true",
                                 "critic_engine.fsdp.offload_params=true",
                                 "ref_engine.optimizer_dtype=bfloat16"])
    e = engines(cfg)
    assert not e["engine"].fsdp.offload_params and e["engine"].optimizer_dtype == "float32"
    critic = e["critic_engine"]
    assert critic.fsdp.offload_params and critic.fsdp.per_layer_optim_step  # merged key-wise
    assert critic.gradient_checkpointing and critic.optimizer_dtype == "float32"
    ref = e["ref_engine"]
    assert ref.optimizer_dtype == "bfloat16" and not ref.fsdp.offload_params
    assert ref.gradient_checkpointing
    # the overrides stay overrides in config.yaml: a later engine: change reaches them
    again = serde.from_yaml(serde.to_yaml(cfg), RECIPE_CONFIGS["ppo"])
    assert again.critic_engine == {"fsdp": {"offload_params": True}}


def test_a_critic_never_takes_the_policys_lora_and_lora_replaces_the_reference():
    cfg = default_config("ppo", ["engine.lora.rank=4"])
    e = engines(cfg)
    assert e["engine"].lora.rank == 4 and e["critic_engine"].lora is None
    assert "ref_engine" not in e  # the policy with its adapters disabled
    critic = build_engine(e["critic_engine"], model_path="m", device="cpu", optimizer=None,
                          seed=0, critic=True)
    assert critic.is_critic and critic.lora is None


REFUSALS = [
    ("grpo", ["mb_spec.max_tokens_per_mb=512"], "mb_spec: not a key here, moved to engine.mb_spec"),
    ("sft", ["lora.rank=8"], "lora: not a key here, moved to engine.lora"),
    ("dpo", ["dtype=float32"], "dtype: not a key here, moved to engine.dtype"),
    ("grpo", ["engine.model_path=/m"], "engine.model_path: not a key here, set by model.path"),
    ("grpo", ["engine.optimizer.lr=1"], "engine.optimizer: not a key here, set by optimizer (top"),
    # an optimizer setting written where a learning rate is often looked for: its home, not
    # the look-alike 'lora'
    ("grpo", ["engine.lr=1e-5"], "engine.lr: not a key here, set by optimizer.lr (ppo's critic: "
                                 "critic_optimizer.lr; the warm-up: warmup.optimizer.lr)"),
    ("ppo", ["ref_engine.weight_decay=0.1"], "ref_engine.weight_decay: not a key here, set by "
                                              "optimizer.weight_decay"),
    ("ppo", ["lr=1e-5"], "lr: not a key here, set by optimizer.lr (the critic: "
                         "critic_optimizer.lr; the warm-up: warmup.optimizer.lr)"),
    ("sft", ["max_grad_norm=1"], "max_grad_norm: not a key here, set by optimizer.max_grad_norm"),
    ("grpo", ["warmup.lr=1e-3"], "warmup.lr: not a key here, set by warmup.optimizer.lr"),
    ("rw", ["engine.is_critic=true"], "engine.is_critic: not a key here, set by the recipe"),
    ("grpo", ["engine.gradient_checkpoint=true"],
     "engine: unknown key(s) ['gradient_checkpoint']; did you mean 'gradient_checkpointing'?"),
    ("ppo", ["critic_engine.fsdp.offload_param=true"],
     "critic_engine.fsdp: unknown key(s) ['offload_param']; did you mean 'offload_params'?"),
    ("ppo", ["critic_engine.bogus=1"], "critic_engine: unknown key(s) ['bogus'] (allowed:"),
    ("grpo", ["ref_engine.optimizer_dtyp=bfloat16"],
     "ref_engine: unknown key(s) ['optimizer_dtyp']; did you mean 'optimizer_dtype'?"),
    ("sft", ["ref_engine.dtype=float32"],
     "ref_engine: not a key here, a key of the grpo, ppo and dpo recipes, not of sft (fsdpfn "
     "config sft prints its keys)"),
    ("grpo", ["critic_engine.dtype=float32"],
     "critic_engine: not a key here, a key of the ppo recipe, not of grpo"),
    # a step's size copied from another recipe's YAML: this recipe's own key, named
    ("dpo", ["batch_size=8"],
     "batch_size: not a key here, the dpo recipe sizes its steps by pairs_per_step (pairs a "
     "step)"),
    ("sft", ["prompts_per_step=8"],
     "prompts_per_step: not a key here, the sft recipe sizes its steps by batch_size (samples a "
     "step)"),
    ("grpo", ["pairs_per_step=8"],
     "pairs_per_step: not a key here, the grpo recipe sizes its steps by prompts_per_step "
     "(problems a step)"),
    ("sft", ["batch_sise=8"], "unknown key(s) ['batch_sise']; did you mean 'batch_size'?"),
    # a grpo YAML made ppo: both of its advantage keys named in the one line
    ("ppo", ["advantage.estimator=grpo", "advantage.group_size=4"],
     "advantage.estimator: must be 'gae' for recipe 'ppo' (it trains a critic), got 'grpo'; "
     "advantage.group_size must then be 1 too (one answer per prompt), got 4"),
    ("ppo", ["advantage.group_size=4"],
     "advantage.group_size: must be 1 for recipe 'ppo' (one answer per prompt), got 4"),
    ("ppo", ["critic_engine.lora.rank=4"], "critic_engine.lora: must be null"),
    ("dpo", ["engine.lora.rank=4", "ref_engine.dtype=float32"],
     "ref_engine: with engine.lora the reference is the policy"),
    ("grpo", ["engine.dtype=float16"], "engine.dtype: must be one of"),
    ("grpo", ["prompts_per_step=2", "advantage.group_size=2"],
     "ppo.n_minibatches: must be <= the rows of a step (prompts_per_step x "
     "advantage.group_size = 2 x 2 = 4; an empty minibatch trains on nothing), got 8"),
    ("grpo", ["engine.fsdp.optim_step_prefetch_layers=2"],
     "engine.fsdp.optim_step_prefetch_layers: only used with per_layer_optim_step=True"),
]


@pytest.mark.parametrize("recipe,overrides,message", REFUSALS)
def test_refusals_name_the_key_and_its_home(recipe, overrides, message):
    with pytest.raises(ConfigError) as info:
        default_config(recipe, overrides)
    assert message in str(info.value) and "\n" not in str(info.value), str(info.value)


# ---------------------------------------------------------------- the budget


def test_an_explicit_budget_below_the_longest_row_is_refused():
    limits = ["data.max_prompt_tokens=512", "data.max_response_tokens=1024"]
    default_config("grpo", FILES + limits + ["engine.mb_spec.max_tokens_per_mb=1536"])
    with pytest.raises(ConfigError, match=r"^engine.mb_spec.max_tokens_per_mb: must be >= "
                                          r"data.max_prompt_tokens \+ data.max_response_tokens"
                                          r" = 512 \+ 1024 = 1536 tokens.*got 1535"):
        default_config("grpo", FILES + limits + ["engine.mb_spec.max_tokens_per_mb=1535"])
    # per cp rank: ceil(1536 / 2) = 768
    cp = ["parallel.cp=2"]
    default_config("grpo", FILES + limits + cp + ["engine.mb_spec.max_tokens_per_mb=768"])
    with pytest.raises(ConfigError, match=r"/ parallel.cp 2 = 768 tokens.*got 767"):
        default_config("grpo", FILES + limits + cp + ["engine.mb_spec.max_tokens_per_mb=767"])
    # a pair is kept whole in rw and dpo: 2 x 1536
    with pytest.raises(ConfigError, match=r"= 3072 tokens.*got 3071"):
        default_config("dpo", FILES + limits + ["engine.mb_spec.max_tokens_per_mb=3071"])
    # the reference's own budget too
    with pytest.raises(ConfigError, match=r"^ref_engine.mb_spec.max_tokens_per_mb: .*got 100"):
        default_config("grpo", FILES + limits + ["ref_engine.mb_spec.max_tokens_per_mb=100"])


def test_embedded_task_budget_is_its_longest_problem():
    # 2-digit addition: <bos> 99 + 99 = (7 tokens), 198 <eos> (4 tokens)
    default_config("sft", ["engine.mb_spec.max_tokens_per_mb=11"])
    with pytest.raises(ConfigError, match="= 11 tokens"):
        default_config("sft", ["engine.mb_spec.max_tokens_per_mb=10"])


# ---------------------------------------------------------------- preflight


def _data_cfg(tmp_path, rows, recipe="grpo", extra=()):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return default_config(recipe, ["model.path=/models/x", f"data.train_files=[{path}]",
                                   *extra])


def test_preflight_data_names_a_missing_column_and_a_missing_file(tmp_path):
    check_data(_data_cfg(tmp_path, [{"question": "1+1?", "answer": "2"}],
                         extra=["data.prompt_key=question"]))
    with pytest.raises(ConfigError, match=r"^data.prompt_key: column 'prompt' is not in "
                                          r"train_files"):
        check_data(_data_cfg(tmp_path, [{"question": "1+1?", "answer": "2"}]))
    cfg = default_config("grpo", ["model.path=/m", f"data.train_files=[{tmp_path}/no.jsonl]"])
    with pytest.raises(ConfigError, match="^data.train_files: file does not exist"):
        check_data(cfg)


REWARDS = """
def good(prompt, completion, *, answer, sample, **kwargs):
    return 1.0

def positional(prompt, completion):
    return 1.0

def batched(prompts, completions, *, answers, samples, scale):
    return [scale] * len(prompts)
"""


def test_preflight_reward_signature(tmp_path):
    (tmp_path / "rw_mod.py").write_text(REWARDS)
    spec = f"{tmp_path / 'rw_mod.py'}:"
    check_reward(default_config("grpo", [f"reward.fn={spec}good"]))
    check_reward(default_config("grpo", [f"reward.fn={spec}batched", "reward.batched=true",
                                         "reward.kwargs.scale=2"]))
    with pytest.raises(ConfigError, match=r"^reward.fn: .* must accept fn\(prompt, completion, "
                                          r"\*, answer, sample\)"):
        check_reward(default_config("grpo", [f"reward.fn={spec}positional"]))
    with pytest.raises(ConfigError, match=r"must accept fn\(prompts, completions, \*, answers, "
                                          r"samples\)"):
        check_reward(default_config("grpo", [f"reward.fn={spec}batched",
                                             "reward.batched=true"]))
    with pytest.raises(ConfigError, match="^reward.fn: "):
        check_reward(default_config("grpo", [f"reward.fn={spec}missing"]))


def test_preflight_rows_against_max_position_embeddings():
    cfg = default_config("grpo", FILES + ["data.max_prompt_tokens=512",
                                          "data.max_response_tokens=1024"])
    check_positions(cfg, {"max_position_embeddings": 1536})
    with pytest.raises(ConfigError, match=r"^data.max_response_tokens: .* = 1536 tokens must "
                                          r"be <= max_position_embeddings = 1024"):
        check_positions(cfg, {"max_position_embeddings": 1024})


def test_preflight_refuses_a_model_dir_whose_files_do_not_read(tmp_path):
    """check_model_dir reads config.json and each safetensors header (no tensor): a truncated
    download or a corrupt config.json is refused before launch, and the position check never
    runs on a config it could not read."""
    from fsdpfn.app.recipes.model import ModelConfig, check_model_dir
    from fsdpfn.testing import save_tiny_model, tiny_qwen2_config

    model = save_tiny_model(tmp_path / "m", tiny_qwen2_config())
    (model / "tokenizer.json").write_text("{}")
    check_model_dir(ModelConfig(path=str(model)))
    weights = model / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[:-1])
    with pytest.raises(ConfigError) as info:
        check_model_dir(ModelConfig(path=str(model)))
    assert str(info.value) == (f"model.path: each *.safetensors file must be a readable "
                               f"safetensors file, got {str(weights)!r} (Error while "
                               f"deserializing header: incomplete metadata, file not fully "
                               f"covered)")
    check_model_dir(ModelConfig(path=str(model), random_init=True))  # its weights are unread
    weights.write_bytes(whole)
    (model / "config.json").write_text('{"hidden_size": 8,')
    expected = (f"model.path: config.json must be a JSON object, got "
                f"{str(model / 'config.json')!r} (Expecting property name enclosed in double "
                f"quotes: line 1 column 19 (char 18))")
    with pytest.raises(ConfigError) as info:
        check_model_dir(ModelConfig(path=str(model)))
    assert str(info.value) == expected
    with pytest.raises(ConfigError) as info:
        preflight.model_config(default_config("sft", [f"model.path={model}"]))
    assert str(info.value) == expected
    (model / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match=r"config.json must be a JSON object, got .* \(a list\)"):
        check_model_dir(ModelConfig(path=str(model)))


def test_preflight_refuses_lora_targets_the_weights_do_not_have(tmp_path):
    """engine.lora.target_modules are checked against the decoder layers' linear weights named
    in the safetensors headers, with shard_model's rule, before launch."""
    from fsdpfn.testing import save_tiny_model, tiny_qwen2_config

    model = save_tiny_model(tmp_path / "m", tiny_qwen2_config())
    check = preflight.check_lora_targets
    check(default_config("sft", [f"model.path={model}", "engine.lora.rank=4",
                                 "engine.lora.target_modules=[q_proj,down_proj]"]))
    check(default_config("sft", [f"model.path={model}", "engine.lora.rank=4"]))  # all-linear
    with pytest.raises(ConfigError) as info:
        check(default_config("sft", [f"model.path={model}", "engine.lora.rank=4",
                                     "engine.lora.target_modules=[qproj,v_proj]"]))
    assert str(info.value) == (
        "engine.lora.target_modules: must name linear layers of the decoder layers (['down_proj', "
        "'gate_proj', 'k_proj', 'o_proj', 'q_proj', 'up_proj', 'v_proj']) or be ['all-linear'], "
        "got ['qproj']")
    # the model a recipe builds from its config has no weights to read: shard_model checks it
    check(default_config("sft", [f"model.path={model}", "model.random_init=true",
                                 "engine.lora.rank=4", "engine.lora.target_modules=[qproj]"]))


# ---------------------------------------------------------------- the memory estimate

# hidden 8, intermediate 16, 4 layers, vocab 32, 2 heads of 4, 1 kv head, lm_head untied:
#   a layer: q 8x8 + k, v 2 x 8x4 + o 8x8 + gate, up, down 3 x 8x16 + 2 norms x 8 = 592
#   root: embedding 32x8 + lm_head 32x8 + final norm 8 = 520;  all: 4 x 592 + 520 = 2888
SHAPE = ModelShape(hidden=8, intermediate=16, layers=4, vocab=32, heads=2, kv_heads=1,
                   head_dim=4, tied=False)


def _section(**kw):
    fsdp = kw.pop("fsdp", {})
    return attrs.evolve(EngineSection(dtype="bfloat16", **kw), fsdp=ff.FSDPConfig(**fsdp))


def test_shape_counts_parameters():
    assert (SHAPE.layer_params, SHAPE.root_params, SHAPE.params) == (592, 520, 2888)
    hf = {"hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 4, "vocab_size": 32,
          "num_attention_heads": 2, "num_key_value_heads": 1}
    assert ModelShape.from_hf(hf) == SHAPE
    # LoRA rank 2 on every linear: q (8+8)2 + k, v (8+4)2 each + o 32 + gate, up, down
    # (8+16)2 each = 32 + 24 + 24 + 32 + 48 x 3 = 256 a layer, 1024 in all
    assert SHAPE.lora_params(ff.LoRAConfig(rank=2)) == 1024


def test_memory_estimate_by_hand():
    est = estimate_memory(SHAPE, _section(), n_gpus=2, tokens=100)
    # fp32 master and gradients: 4 B x 2888 / 2 GPUs = 5776 each; Adam 2 x 4 B: 11552
    assert (est["weights"], est["gradients"], est["optimizer"]) == (5776, 5776, 11552)
    # two gathered layers and the root in bf16: 2 x (2 x 592 + 520) = 3408, plus one
    # layer's fp32 gradient 4 x 592 = 2368
    assert est["gathered"] == 3408 + 2368
    # saved per token and layer in bf16: 2 x (4 x 8 + 2 x 8 + 2 x 4 + 4 x 16) = 240 B;
    # 100 tokens x 4 layers x 240 = 96000, logits 3 x 4 B x 100 x 32 = 38400
    assert est["activations"] == 96000 + 38400
    assert est["total"] == 5776 * 2 + 11552 + 5776 + 134400
    ckpt = estimate_memory(SHAPE, _section(gradient_checkpointing=True), n_gpus=2, tokens=100)
    # each layer's input (4 x 2 B x 8) plus one layer's tensors: 100 x (64 + 240) + 38400
    assert ckpt["activations"] == 30400 + 38400
    bf16 = estimate_memory(SHAPE, _section(optimizer_dtype="bfloat16"), n_gpus=2, tokens=100)
    # bf16 master and gradients 2 B x 2888 / 2 = 2888; Adam 2 x 2 B + Kahan 2 B = 6 B: 8664
    assert (bf16["weights"], bf16["gradients"], bf16["optimizer"]) == (2888, 2888, 8664)
    per_layer = estimate_memory(SHAPE, _section(fsdp={"per_layer_optim_step": True}),
                                n_gpus=2, tokens=100)
    assert per_layer["optimizer"] == 11552 * 2 / 4  # 1 + 1 prefetched of 4 layers on device
    lora = estimate_memory(SHAPE, _section(lora=ff.LoRAConfig(rank=2)), n_gpus=2, tokens=100)
    # base frozen in bf16: 2 x 2888 / 2 = 2888, adapters fp32 4 x 1024 / 2 = 2048
    assert (lora["weights"], lora["gradients"], lora["optimizer"]) == (2888 + 2048, 2048, 4096)
    offload = estimate_memory(SHAPE, _section(fsdp={"offload_params": True}), n_gpus=2,
                              tokens=100)
    assert offload["weights"] == offload["gradients"] == offload["optimizer"] == 0
    ref = estimate_memory(SHAPE, _section(), n_gpus=2, tokens=100, train=False)
    # inference: fp32 shards, two gathered layers and the root, one layer's tensors
    assert (ref["weights"], ref["gradients"], ref["optimizer"]) == (5776, 0, 0)
    assert ref["gathered"] == 3408 and ref["activations"] == 100 * 240 + 38400


# a 7B-shaped model (Qwen2-7B's config) for the refusal's arithmetic
Q7 = ModelShape(hidden=3584, intermediate=18944, layers=28, vocab=152064, heads=28,
                kv_heads=4, head_dim=128, tied=False)
GRPO_7B = FILES + ["data.max_prompt_tokens=512", "data.max_response_tokens=1024",
                   "prompts_per_step=16", "ppo.n_minibatches=2"]


def test_memory_refusal_names_the_options_that_fit():
    cfg = default_config("grpo", GRPO_7B + ["engine.gradient_checkpointing=true",
                                            "engine.fsdp.per_layer_optim_step=true"])
    total = run_estimate(cfg, Q7, n_gpus=1, shared=True)["total"]
    assert check_memory(cfg, Q7, n_gpus=1, capacity=total / HEADROOM + 1, shared=True)
    with pytest.raises(ConfigError) as info:
        check_memory(cfg, Q7, n_gpus=1, capacity=total / HEADROOM - 1, shared=True)
    msg = str(info.value)
    assert msg.startswith("engine: the run does not fit one GPU, memory estimate per GPU")
    for fix in ("engine.optimizer_dtype=bfloat16", "ref_engine.fsdp.offload_params=true",
                "engine.lora.rank=16", "2 trainer GPUs"):
        assert fix in msg, msg
    # already on: not offered again
    assert "per_layer_optim_step=true or" not in msg and "checkpointing=true or" not in msg


def test_memory_estimate_sums_the_models_of_the_recipe():
    """grpo holds the policy (trained) and the reference (fp32 shards, no gradients); ppo adds
    a critic; engine.lora replaces the reference by the policy without adapters."""
    grpo = run_estimate(default_config("grpo", GRPO_7B), Q7, n_gpus=8, shared=False)
    assert grpo["weights"] == pytest.approx(2 * 4 * Q7.params / 8)
    assert grpo["gradients"] == pytest.approx(4 * Q7.params / 8)
    lora = run_estimate(default_config("grpo", GRPO_7B + ["engine.lora.rank=16"]), Q7,
                        n_gpus=8, shared=False)
    assert lora["weights"] == pytest.approx((2 * Q7.params + 4 * Q7.lora_params(
        ff.LoRAConfig(rank=16))) / 8)
    shared = run_estimate(default_config("grpo", GRPO_7B), Q7, n_gpus=8, shared=True)
    # the server: bf16 weights + 128 slots x 1536 positions x 28 layers x (k, v) x 4 x 128 x 2 B
    assert shared["rollout server"] == 2 * Q7.params + 128 * 1536 * 28 * 2 * 4 * 128 * 2


def test_checkpoint_size_by_hand():
    """fp32: weights 4 B + Adam 8 B a parameter; bf16: 2 B + Kahan AdamW 6 B; LoRA: the
    adapters alone; ppo saves the critic too; the reference is never saved."""
    n = Q7.params
    assert checkpoint_bytes(default_config("grpo", GRPO_7B), Q7) == 12 * n
    bf16 = default_config("grpo", GRPO_7B + ["engine.optimizer_dtype=bfloat16"])
    assert checkpoint_bytes(bf16, Q7) == 8 * n
    lora = default_config("grpo", GRPO_7B + ["engine.lora.rank=16"])
    assert checkpoint_bytes(lora, Q7) == 12 * Q7.lora_params(ff.LoRAConfig(rank=16))
    ppo = default_config("ppo", FILES + ["data.max_prompt_tokens=512",
                                         "data.max_response_tokens=1024"])
    assert checkpoint_bytes(ppo, Q7) == 2 * 12 * n


def test_a_checkpoint_larger_than_the_disk_is_refused_naming_what_fits(monkeypatch, tmp_path):
    cfg = default_config("grpo", GRPO_7B + [f"run_dir={tmp_path / 'run'}"])
    size = 12 * Q7.params
    monkeypatch.setattr(memory, "_free_bytes", lambda path: size + 1.0)
    note = check_disk(cfg, Q7)
    assert note.startswith("checkpoint estimate: 85.1 GiB each") and "keep_last=2" in note
    monkeypatch.setattr(memory, "_free_bytes", lambda path: 3 * size)
    assert "keep_last" not in check_disk(cfg, Q7)
    monkeypatch.setattr(memory, "_free_bytes", lambda path: 10 * Q7.params)  # 71 GiB
    with pytest.raises(ConfigError) as info:
        check_disk(cfg, Q7)
    msg = str(info.value)
    assert msg.startswith("checkpoint: one checkpoint of this run does not fit its disk, "
                          "checkpoint estimate: 85.1 GiB each, 70.9 GiB free")
    assert "engine.optimizer_dtype=bfloat16 or engine.lora.rank=16 or a run_dir" in msg, msg
    monkeypatch.setattr(memory, "_free_bytes", lambda path: 4 * Q7.params)
    with pytest.raises(ConfigError, match="it would fit with engine.lora.rank=16 or a run_dir"):
        check_disk(cfg, Q7)


def test_host_memory_estimate_by_hand():
    """The per-layer step keeps the policy's Adam state on the host (fp32: 8 B a parameter;
    bf16: 6 B with Kahan); offload_params keeps weights, gradients and Adam state there; the
    reference's offloaded weights add theirs; nothing on the host: no note."""
    n = Q7.params
    assert check_host_memory(default_config("grpo", GRPO_7B), Q7, available=1e12) is None
    per_layer = default_config("grpo", GRPO_7B + ["engine.fsdp.per_layer_optim_step=true"])
    assert host_bytes(per_layer, Q7) == {"optimizer state": 8 * n,
                                         "offloaded weights and gradients": 0.0}
    bf16 = default_config("grpo", GRPO_7B + ["engine.fsdp.per_layer_optim_step=true",
                                             "engine.optimizer_dtype=bfloat16"])
    assert host_bytes(bf16, Q7)["optimizer state"] == 6 * n  # the reference inherits bf16
    offload = default_config("grpo", GRPO_7B + ["engine.fsdp.offload_params=true"])
    # policy: fp32 weights + gradients + Adam; reference (inherits the offload): fp32 weights
    assert host_bytes(offload, Q7) == {"optimizer state": 8 * n,
                                       "offloaded weights and gradients": (4 + 4 + 4) * n}
    ref_only = default_config("grpo", GRPO_7B + ["ref_engine.fsdp.offload_params=true"])
    assert host_bytes(ref_only, Q7) == {"optimizer state": 0.0,
                                        "offloaded weights and gradients": 4 * n}


def test_host_memory_refusal_names_what_fits():
    """A 14B-sized fp32 per-layer run on a host with 120 GiB available: its moments (110 GiB)
    pass 90% of it; the bf16 state's (82 GiB) do not."""
    q14 = ModelShape(hidden=5120, intermediate=13824, layers=48, vocab=152064, heads=40,
                     kv_heads=8, head_dim=128, tied=False)
    cfg = default_config("grpo", GRPO_7B + ["engine.fsdp.per_layer_optim_step=true"])
    host = 120 * GiB
    with pytest.raises(ConfigError) as info:
        check_host_memory(cfg, q14, available=host)
    msg = str(info.value)
    assert msg.startswith("engine: the run's host-side state does not fit this host's memory, "
                          "host memory estimate: 110."), msg
    assert msg.endswith("it would fit with engine.optimizer_dtype=bfloat16 or "
                        "engine.lora.rank=16 or a host with more memory"), msg
    note = check_host_memory(default_config("grpo", GRPO_7B + [
        "engine.fsdp.per_layer_optim_step=true", "engine.optimizer_dtype=bfloat16"]), q14,
        available=host)
    assert note.startswith("host memory estimate: 82.") and "optimizer state 82." in note, note


def test_host_memory_is_read_from_meminfo():
    import os
    import sys

    available = preflight.available_host_memory()
    if not sys.platform.startswith("linux") or not os.path.exists("/proc/meminfo"):
        assert available is None
        return
    kb = next(int(line.split()[1]) for line in open("/proc/meminfo")
              if line.startswith("MemAvailable:"))
    assert available is not None and abs(available - kb * 1024) < 2 ** 30  # read a moment apart


def test_free_space_is_read_where_the_run_dir_will_be(tmp_path):
    import shutil

    free = memory._free_bytes(tmp_path / "not" / "yet" / "made")
    assert abs(free - shutil.disk_usage(tmp_path).free) < 2 ** 30


# ---------------------------------------------------------------- a section written in part


def _written_one_key_at_a_time(cls, defaults: dict, prefix=()):
    """(dotted path, value, data) for every scalar or list key of every section of ``cls``, at any
    depth: the recipe's data with that one key written, at its recipe default."""
    for key, sub in serde._sections(cls).items():
        section = defaults.get(key)
        if not isinstance(section, dict):
            continue
        for name, value in section.items():
            if name in serde._sections(sub) and isinstance(value, dict):
                continue
            data = {name: value}
            for part in reversed(prefix + (key,)):
                data = {part: data}
            yield ".".join(prefix + (key, name)), value, data
        yield from _written_one_key_at_a_time(sub, section, prefix + (key,))


@pytest.mark.parametrize("recipe", ["grpo", "ppo", "sft", "rw", "dpo"])
def test_a_section_written_in_part_keeps_the_recipes_other_defaults(recipe):
    """Writing one key of a section (at its value) leaves the whole config as the recipe's
    default: the keys not written keep the recipe's values, not the section class's."""
    from fsdpfn.app.recipes import RECIPE_CONFIGS, config_from_data

    default = default_config(recipe)
    cls = RECIPE_CONFIGS[recipe]
    cases = list(_written_one_key_at_a_time(cls, serde.unstructure(default)))
    assert len(cases) > 50, len(cases)
    for dotted, value, data in cases:
        assert config_from_data({"recipe": recipe, **data}) == default, dotted
        assert config_from_data({"recipe": recipe}, [f"{dotted}={json.dumps(value)}"]) \
            == default, dotted


def test_what_a_partial_section_changes_and_keeps():
    from fsdpfn.app.recipes import config_from_data

    grpo = config_from_data({"recipe": "grpo", "ppo": {"n_minibatches": 2}})
    assert grpo.ppo == attrs.evolve(default_config("grpo").ppo, n_minibatches=2)
    assert grpo.ppo.kl_coef == 0.01 and grpo.ppo.clip_high == 0.28  # grpo's, not PPOConfig's
    ppo = config_from_data({"recipe": "ppo", "advantage": {"gamma": 0.99}})
    assert ppo.advantage.estimator == "gae" and ppo.advantage.gamma == 0.99
    sft = config_from_data({"recipe": "sft", "optimizer": {"warmup_steps": 5}})
    assert sft.optimizer.lr == default_config("sft").optimizer.lr
    # a section written as null where the recipe has one, or a mapping field, replaces it whole
    assert config_from_data({"recipe": "grpo", "engine": {"lora": {"rank": 4}}}).engine.lora.rank \
        == 4


@pytest.mark.parametrize("recipe", ["sft", "rw", "dpo"])
def test_the_supervised_recipes_all_read_a_null_eval_every_as_a_fifth_of_the_run(recipe):
    from fsdpfn.app.recipes.supervised import _eval_every

    cfg = default_config(recipe, ["eval_every=null", "steps=50"])
    assert cfg.eval_every is None and _eval_every(cfg) == 10
    assert _eval_every(default_config(recipe, ["eval_every=null", "steps=3"])) == 1
    with pytest.raises(ConfigError, match="eval_every: must be"):
        default_config(recipe, ["eval_every=-1"])


def test_a_model_dir_of_pytorch_weights_names_the_conversion(tmp_path):
    """A directory with pytorch_model.bin and no safetensors: refused before launch, naming the
    file and how to convert it once (fsdpfn never unpickles); without either, the plain rule."""
    import torch
    from fsdpfn.app.recipes.model import ModelConfig, check_model_dir
    from fsdpfn.testing import save_tiny_model, tiny_qwen2_config

    model = save_tiny_model(tmp_path / "m", tiny_qwen2_config())
    (model / "tokenizer.json").write_text("{}")
    (model / "model.safetensors").unlink()
    with pytest.raises(ConfigError) as info:
        check_model_dir(ModelConfig(path=str(model)))
    assert str(info.value) == (f"model.path: must hold *.safetensors weights (or set "
                               f"model.random_init=true), got {str(model)!r} (no .safetensors "
                               f"file)")
    torch.save({"w": torch.zeros(1)}, model / "pytorch_model.bin")
    with pytest.raises(ConfigError) as info:
        check_model_dir(ModelConfig(path=str(model)))
    message = str(info.value)
    assert message.startswith(f"model.path: must hold *.safetensors weights (or set "
                              f"model.random_init=true), got {str(model)!r} (it holds PyTorch "
                              f"weights, pytorch_model.bin, which fsdpfn does not read: "
                              f"convert them once with transformers, ")
    assert "save_pretrained(NEW_DIR)" in message and "\n" not in message
    check_model_dir(ModelConfig(path=str(model), random_init=True))  # no weights read
