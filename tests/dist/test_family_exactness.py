"""Two things that kept a model from being computed as its own forward computes it, or refused
it when it was:

- disable_dropout (the default) turns off every dropout a family applies, its functional ones
included: Seed-OSS's residual_dropout, GPT-BigCode's attn_pdrop and BioGPT's
hidden_dropout_prob are read by the modeling code itself, outside any nn.Dropout module, and
trained with dropout on while the log-probs (an evaluation forward) were exact.

The reference is the definition of an on-policy step: on the weights that computed old_logp,
every PPO ratio is exactly 1 (it was up to 1.48 with transformers' default 0.1 rates), and the
SFT loss equals the mean of the log-probs forward_logp gives.

- the architecture probe (the small model of the same architecture that families outside the
verified list are checked on) keeps a real model's rotary share (GPT-J's and CodeGen's
rotary_dim) and Falcon's num_kv_heads in step with its smaller heads: real-shaped models were
refused with a tensor-size error. They build, and their log-probs equal their own float64
forward.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

import fsdpfn as ff
from fsdpfn import keys as K
from fsdpfn.testing.models import exact_here, save_family_model

pytestmark = pytest.mark.dist

TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
# transformers' defaults for these rates are 0.1: written out, so the test holds if they change
FAMILIES = {
    "seed_oss": dict(model_type="seed_oss", head_dim=16, residual_dropout=0.1,
                     attention_dropout=0.1),
    "gpt_bigcode": dict(model_type="gpt_bigcode", attn_pdrop=0.1, resid_pdrop=0.1,
                        embd_pdrop=0.1),
    "biogpt": dict(model_type="biogpt", hidden_dropout_prob=0.1,
                   attention_probs_dropout_prob=0.1, layerdrop=0.1),
}


def _batch():
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([40, 23, 33, 17])
    attn = torch.arange(40)[None] < lengths[:, None]
    ids = torch.where(attn, torch.randint(3, 97, (4, 40), generator=g), 0)
    loss = attn.clone()
    loss[:, :3] = False
    return TensorDict({K.INPUT_IDS: ids, K.ATTENTION_MASK: attn, K.LOSS_MASK: loss},
                      batch_size=[4])


def on_policy_step(path):
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=-1), device_type="cpu")
    state = ff.shard_model(ff.EngineConfig(model_path=path, dtype="float32",
                                           optimizer=ff.OptimizerConfig(lr=1e-6)), mesh)
    batch = ff.forward_logp(state, ff.shard_batch(_batch(), mesh), out_key=K.OLD_LOGP)
    batch[K.ADVANTAGES] = torch.linspace(-1, 1, batch[K.INPUT_IDS].numel()).view(
        batch[K.INPUT_IDS].shape) * batch[K.LOSS_MASK]
    _, stats = ff.ppo_step(state, batch, ff.PPOConfig())
    return float(stats["ratio_max"]), float(stats["ratio_mean"])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_dropout_of_a_family_is_off_in_training(spmd1, tmp_path, family):
    path = save_family_model(tmp_path / family, {**TINY, **FAMILIES[family]})
    ratio_max, ratio_mean = spmd1.run(on_policy_step, args=(str(path),), timeout=200)[0]
    assert ratio_max == 1.0 and ratio_mean == 1.0, (family, ratio_max, ratio_mean)


def export_and_push(path, out):
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=-1), device_type="cpu")
    state = ff.shard_model(ff.EngineConfig(model_path=path, dtype="float32",
                                           optimizer=ff.OptimizerConfig(lr=1e-6)), mesh)
    ff.export_hf(state, f"{out}/export")
    ff.push_weights(state, ff.DiskTarget(f"{out}/push"))
    return {k: v for k, v in vars(state.hf_config).items() if "drop" in k}


@pytest.mark.timeout(240)
def test_a_written_config_keeps_the_models_own_dropout_fields(spmd1, tmp_path):
    """Training runs with the dropout fields at 0 (the test above), but the config.json that
    export_hf and a disk push write is the model's own: it once carried the zeros, so an
    exported model's config depended on a training switch."""
    import json

    spec = {**TINY, **FAMILIES["seed_oss"]}
    path = save_family_model(tmp_path / "m", spec)
    trained = spmd1.run(export_and_push, args=(str(path), str(tmp_path)), timeout=200)[0]
    assert trained["residual_dropout"] == 0 and trained["attention_dropout"] == 0
    source = json.loads((path / "config.json").read_text())
    pushed = next((tmp_path / "push").glob("v*/config.json"))
    for written in (tmp_path / "export" / "config.json", pushed):
        config = json.loads(written.read_text())
        for key in ("residual_dropout", "attention_dropout"):
            assert config[key] == source[key] == 0.1, (written, key, config[key])


PROBED = {
    "gptj": dict(model_type="gptj", hidden_size=256, num_attention_heads=4, rotary_dim=32),
    "codegen": dict(model_type="codegen", hidden_size=256, num_attention_heads=4,
                    rotary_dim=32),
    "falcon-40b-like": dict(model_type="falcon", hidden_size=128, num_attention_heads=16,
                            num_kv_heads=8, new_decoder_architecture=True),
}


def logp_of(path):
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=-1), device_type="cpu")
    state = ff.shard_model(ff.EngineConfig(model_path=path, dtype="float32"), mesh)
    return ff.gather_batch(ff.forward_logp(state, ff.shard_batch(_batch(), mesh)), mesh)[K.LOGP]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", sorted(PROBED))
def test_real_shaped_rotary_and_kv_head_settings_pass_the_probe_and_are_exact(spmd1, tmp_path,
                                                                              name):
    from transformers import AutoModelForCausalLM

    from fsdpfn.testing.models import hf_reference_logp

    spec = {**TINY, **PROBED[name]}
    if "num_kv_heads" in spec:  # Falcon's own name of it
        del spec["num_key_value_heads"]
    path = save_family_model(tmp_path / name, spec)
    if not exact_here(spec["model_type"]):  # refused by name, never computed wrongly
        kind, message = spmd1.run(build, args=(str(path), False), timeout=200)[0]
        assert kind == "ConfigError" and message.startswith(
            f"model_type: {spec['model_type']!r} is not"), message
        return
    ours = spmd1.run(logp_of, args=(str(path),), timeout=200)[0]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    batch = _batch()
    with torch.no_grad():
        gap = max(float((ours[i, :n] - hf_reference_logp(
            model, batch[K.INPUT_IDS][i:i + 1, :n], batch[K.ATTENTION_MASK][i:i + 1, :n])[0][0]
        ).abs().max()) for i, n in enumerate(batch[K.ATTENTION_MASK].sum(1).tolist()))
    assert gap < 1e-5, (name, gap)


def build(path, checkpointing, **options):
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=-1), device_type="cpu")
    try:
        ff.shard_model(ff.EngineConfig(model_path=path, dtype="float32",
                                       gradient_checkpointing=checkpointing, **options), mesh)
    except Exception as exc:  # noqa: BLE001 - the error's type is what is checked
        return type(exc).__name__, str(exc)
    return None


@pytest.mark.timeout(240)
def test_a_family_without_checkpointing_is_refused_by_a_typed_error(spmd1, tmp_path):
    """CTRL's modeling code has no activation checkpointing: transformers' ValueError reached
    the caller as it was; it is a ConfigError naming the family and the field."""
    path = save_family_model(tmp_path / "ctrl", {**TINY, "model_type": "ctrl"})
    if not exact_here("ctrl"):  # refused by name with or without checkpointing
        for checkpointing in (False, True):
            kind, message = spmd1.run(build, args=(str(path), checkpointing), timeout=200)[0]
            assert kind == "ConfigError" and "'ctrl'" in message, message
        return
    assert spmd1.run(build, args=(str(path), False), timeout=200)[0] is None
    kind, message = spmd1.run(build, args=(str(path), True), timeout=200)[0]
    assert kind == "ConfigError" and message.startswith(
        "gradient_checkpointing: model_type 'ctrl' does not support it"), message


@pytest.mark.timeout(240)
def test_a_family_with_its_own_attention_table_is_refused_by_name_unchecked_too(spmd1,
                                                                                tmp_path):
    """verify_model='never' skips the probe, which named a family whose modeling looks its
    attention up in a table of its own (Falcon before transformers 5.25); the build's KeyError
    on the engine's attention name reached the caller as it was. Where transformers routes the
    family, it builds."""
    spec = {**TINY, **PROBED["falcon-40b-like"]}
    del spec["num_key_value_heads"]
    path = save_family_model(tmp_path / "falcon", spec)
    got = spmd1.run(build, args=(str(path), False), kwargs={"verify_model": "never"},
                    timeout=200)[0]
    if exact_here("falcon"):
        assert got is None, got
    else:
        kind, message = got
        assert kind == "ConfigError" and message.startswith(
            "model_type: 'falcon' is not supported with transformers"), message
