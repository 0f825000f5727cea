"""Each step runs on the kind of state it is for: a policy step (sft, dpo, ppo) on a critic
state, or a critic step (critic, rw) on a policy state, is a ConfigError naming the function and
both kinds, raised before anything runs and leaving the state usable. critic_step without value
clipping reads no old values, and its loss is ½ (v - R)² against Hugging Face's own head."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, Qwen2Config

import fsdpfn as ff
from fsdpfn import keys as K
from fsdpfn.errors import BatchError, ConfigError
from fsdpfn.testing import random_batch

OPT = ff.OptimizerConfig(lr=1e-2, weight_decay=0.0, max_grad_norm=None)


CONFIG = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
              num_labels=1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(5)
    path = tmp_path_factory.mktemp("kinds")
    AutoModelForCausalLM.from_config(Qwen2Config(**CONFIG)).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def critic_dir(tmp_path_factory):
    """A saved token-classification model: its value head is part of the checkpoint."""
    torch.manual_seed(6)
    model = AutoModelForTokenClassification.from_config(Qwen2Config(**CONFIG))
    with torch.no_grad():
        model.score.weight.normal_(0.0, 0.5)  # values far from zero
    path = tmp_path_factory.mktemp("critic")
    model.save_pretrained(path)
    return path


def _state(path, critic: bool):
    mesh = ff.build_mesh(ff.ParallelStrategy(), device_type="cpu")
    return ff.shard_model(ff.EngineConfig(model_path=str(path), is_critic=critic, dtype="float32",
                                          optimizer=OPT), mesh)


def _batch():
    batch = random_batch(4, 16, seed=3, min_len=6)
    shape = batch[K.INPUT_IDS].shape
    batch[K.REF_LOGP] = -torch.rand(shape) * batch[K.ATTENTION_MASK]
    batch[K.OLD_LOGP] = batch[K.REF_LOGP].clone()
    batch[K.ADVANTAGES] = torch.randn(shape) * batch[K.LOSS_MASK]
    batch[K.RETURNS] = torch.randn(shape) * batch[K.LOSS_MASK]
    batch[K.VALUES] = torch.zeros(shape)
    return batch


CASES = [
    ("sft_step", True, lambda s, b: ff.sft_step(s, b)),
    ("dpo_step", True, lambda s, b: ff.dpo_step(s, b)),
    ("ppo_step", True, lambda s, b: ff.ppo_step(s, b, ff.PPOConfig(kl_coef=0.0))),
    ("critic_step", False, lambda s, b: ff.critic_step(s, b, ff.CriticConfig())),
    ("rw_step", False, lambda s, b: ff.rw_step(s, b)),
    ("evaluate", True, lambda s, b: ff.evaluate(s, b, ff.algos.sft_objective(ff.SFTConfig()))),
]


@pytest.mark.parametrize("name, critic, call", CASES, ids=[c[0] for c in CASES])
def test_a_step_on_the_other_kind_of_state_is_refused_by_name(model_dir, name, critic, call):
    state, batch = _state(model_dir, critic), _batch()
    before = {k: v.detach().clone() for k, v in state.model.state_dict().items()}
    with pytest.raises(ConfigError) as info:
        call(state, batch)
    want = "policy" if critic else "critic"
    assert str(info.value) == (f"{name}: needs a {want} state (EngineConfig(is_critic="
                               f"{not critic})), got is_critic={critic}")
    after = state.model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    if critic:  # the state was not donated: it still runs its own kind of step
        ff.critic_step(state, batch, ff.CriticConfig())
    else:
        ff.sft_step(state, batch)


def test_critic_step_without_value_clip_needs_no_old_values(critic_dir):
    batch = random_batch(4, 16, seed=4, min_len=6)
    g = torch.Generator().manual_seed(1)
    batch[K.RETURNS] = torch.randn(batch[K.INPUT_IDS].shape, generator=g) * batch[K.LOSS_MASK]
    _, stats = ff.critic_step(_state(critic_dir, True), batch,
                              ff.CriticConfig(value_clip=None, agg="token-mean"))
    # float64 reference: HF's token-classification head, values[t] = head at t - 1
    model = AutoModelForTokenClassification.from_pretrained(critic_dir, dtype=torch.float64)
    mask = batch[K.LOSS_MASK]
    with torch.no_grad():
        head = model(input_ids=batch[K.INPUT_IDS],
                     attention_mask=batch[K.ATTENTION_MASK]).logits[..., 0]
    values = torch.cat((torch.zeros(4, 1, dtype=torch.float64), head[:, :-1]), dim=1)
    losses = 0.5 * (values - batch[K.RETURNS].double()).square()
    want = float(losses[mask].mean())
    assert abs(float(stats["loss"]) - want) <= 1e-5, (float(stats["loss"]), want)
    assert float(stats["vf_clip_frac"]) == 0.0
    # with clipping the values before the update are needed, and the error names them
    with pytest.raises(BatchError, match=r"missing key 'old_values' \(needed for value "
                                         r"clipping \(value_clip=0.2\).*compute_values"):
        ff.critic_step(_state(critic_dir, True), batch, ff.CriticConfig(value_clip=0.2))


def test_the_rw_recipe_refuses_lora_by_name():
    from fsdpfn.app.recipes import default_config

    with pytest.raises(ConfigError, match=r"^engine.lora: the rw recipe trains its reward model "
                                          r"in full .* must be null, got rank=4$"):
        default_config("rw", ["engine.lora.rank=4"])
    assert default_config("rw").engine.lora is None
