"""Every verified family that has a critic (a token-classification model: rw's reward model,
ppo's value model) computes what its own Hugging Face forward computes, and the rest are
refused as critics by name.

One process, CPU. For each variant of fsdpfn.testing.tiny_family_configs whose model_type has a
token-classification class, a tiny critic (one label, every parameter perturbed) is saved and:
- compute_values equals the model's own eager float64 head, shifted as the batch contract says
  (values[t] is the head at token t-1; 0 at t = 0 and on padding), to 1e-5;
- compute_scores equals the head at each row's last real token, and rw_step's loss equals the
  Bradley-Terry loss of those scores;
- one critic_step's loss equals ½·token-mean (v - R)² of the model's own values, and its update
  equals the update the same optimizer makes from the model's own gradients.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from tensordict import TensorDict

import fsdpfn as ff
from fsdpfn import keys as K
from fsdpfn.engine.families import CRITIC_VERIFIED, VERIFIED
from fsdpfn.engine.packed import length_dependent_rotaries
from fsdpfn.errors import ConfigError
from fsdpfn.testing.models import REFERENCE_STEP, hf_config_of, tiny_family_configs
from fsdpfn.testing.strategies import batch_from_lengths

LENGTHS = (64, 41, 53, 47)  # every row longer than the window (12); rows 0/1 and 2/3 are pairs
# float32 against the float64 head, relative to the largest value (about 1 to 3 here); a
# missed window, softcap, scale or bias moves values by 1e-2 of that or more
TOL = 1e-5


def _has_critic_class(model_type: str) -> bool:
    from transformers import CONFIG_MAPPING, AutoModelForTokenClassification

    return CONFIG_MAPPING[model_type] in AutoModelForTokenClassification._model_mapping


FAMILIES = {name: spec for name, spec in tiny_family_configs().items()
            if _has_critic_class(spec["model_type"])}
NO_CRITIC = sorted({spec["model_type"] for spec in tiny_family_configs().values()}
                   - {spec["model_type"] for spec in FAMILIES.values()})


def _batch(seed: int = 0) -> TensorDict:
    """Rows of LENGTHS tokens (vocabulary 131), the loss from the fourth token on, and
    returns on the loss tokens."""
    batch = batch_from_lengths(list(LENGTHS), max(LENGTHS), seed=seed, vocab_size=131,
                               prompt_lens=[3] * len(LENGTHS)).exclude(K.REWARDS)
    g = torch.Generator().manual_seed(seed)
    returns = torch.randn(batch[K.LOSS_MASK].shape, generator=g)
    return batch.set(K.RETURNS, torch.where(batch[K.LOSS_MASK], returns, 0.0).float())


def _save_critic(path: Path, spec: dict, *, seed: int = 3, noise: float = 0.05) -> str:
    from transformers import AutoModelForTokenClassification

    config = hf_config_of(spec)
    config.num_labels = 1
    torch.manual_seed(seed)
    model = AutoModelForTokenClassification.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * noise)
        model.score.weight.mul_(5.0)  # a head far from zero, so values differ by token
    model.save_pretrained(path, safe_serialization=True)
    return str(path)


@pytest.fixture(scope="module")
def critic_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("critics")
    return {name: _save_critic(root / name, spec) for name, spec in FAMILIES.items()}


def _hf_head(model_dir: str, batch, dtype=torch.float64):
    """The model's own eager head output [B, T] (0 on padding) and the model.

    Row by row, unpadded: a padded row's queries past its end see no key inside a sliding
    window, and their NaNs reach the real tokens of the next layer in float64. A model whose
    rotary frequencies follow the highest position (dynamic NTK, longrope) runs on the
    right-padded batch instead, as forward_logp's reference does: every row rotates with the
    batch's highest position, which row by row would hold only where transformers keeps the
    longest length a module has seen (5.25 does, 5.0 does not)."""
    from transformers import AutoModelForTokenClassification

    model = AutoModelForTokenClassification.from_pretrained(model_dir, dtype=dtype,
                                                            attn_implementation="eager")
    model.eval()
    attn = batch[K.ATTENTION_MASK]
    if length_dependent_rotaries(model):
        heads = model(input_ids=batch[K.INPUT_IDS], attention_mask=attn.long(),
                      use_cache=False).logits[..., 0]
        return torch.where(attn, heads, torch.zeros((), dtype=heads.dtype)), model
    heads = torch.zeros(batch.batch_size[0], batch[K.INPUT_IDS].shape[1], dtype=dtype)
    for b, n in enumerate(LENGTHS):
        out = model(input_ids=batch[K.INPUT_IDS][b:b + 1, :n]).logits[0, :, 0]
        heads = heads.index_put((torch.tensor([b]), torch.arange(n)), out)
    return heads, model


def _shifted(heads: torch.Tensor) -> torch.Tensor:
    """values[t] = head[t - 1], 0 at t = 0 and on padding."""
    attn = torch.arange(heads.shape[1])[None] < torch.tensor(LENGTHS)[:, None]
    shifted = torch.cat([torch.zeros_like(heads[:, :1]), heads[:, :-1]], dim=1)
    return torch.where(attn, shifted, torch.zeros_like(shifted))


def _critic(model_dir: str, optimizer=None):
    mesh = ff.build_mesh(ff.ParallelStrategy(), device_type="cpu")
    return ff.shard_model(ff.EngineConfig(model_path=model_dir, is_critic=True, dtype="float32",
                                          optimizer=optimizer), mesh)


def test_the_critic_families_are_the_verified_ones_with_a_token_classification_class():
    assert sorted(CRITIC_VERIFIED) == sorted({s["model_type"] for s in FAMILIES.values()})
    assert set(CRITIC_VERIFIED) < set(VERIFIED)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_values_and_scores_equal_the_models_own_head(family, critic_dirs):
    batch = _batch()
    with torch.no_grad():
        heads, _ = _hf_head(critic_dirs[family], batch)
    state = _critic(critic_dirs[family])
    values = ff.compute_values(state, batch)[K.VALUES]
    assert values.dtype == torch.float32 and values.shape == batch[K.INPUT_IDS].shape
    want = _shifted(heads)
    assert float(want.abs().max()) > 0.1  # the head is far from zero
    scale = float(want.abs().max())
    gap = float((values.double() - want).abs().max()) / scale
    assert gap <= TOL, f"{family}: values differ from the model's own head by {gap:.3g} of " \
                       f"{scale:.3g}"
    scores = ff.compute_scores(state, batch)["scores"].double()
    last = heads[torch.arange(len(LENGTHS)), torch.tensor(LENGTHS) - 1]
    gap = float((scores - last).abs().max()) / scale
    assert gap <= TOL, f"{family}: scores differ from the head at the last token by {gap:.3g}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_rw_step_loss_is_bradley_terry_of_the_models_own_scores(family, critic_dirs):
    batch = _batch(seed=1).exclude(K.RETURNS)
    with torch.no_grad():
        heads, _ = _hf_head(critic_dirs[family], batch)
    last = heads[torch.arange(len(LENGTHS)), torch.tensor(LENGTHS) - 1]
    margins = last[0::2] - last[1::2]
    want = float(torch.mean(-torch.nn.functional.logsigmoid(margins)))
    state = _critic(critic_dirs[family], ff.OptimizerConfig(lr=1e-3))
    _, stats = ff.rw_step(state, batch, ff.RWConfig())
    assert math.isclose(float(stats["loss"]), want, abs_tol=TOL), (family, float(stats["loss"]),
                                                                  want)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_critic_step_loss_and_update_equal_the_models_own(family, critic_dirs):
    batch = _batch(seed=2)
    heads, model = _hf_head(critic_dirs[family], batch)  # float64: the gradients' reference
    mask = batch[K.LOSS_MASK]
    v = _shifted(heads)
    loss = (0.5 * (v - batch[K.RETURNS]) ** 2 * mask).sum() / mask.sum()  # token-mean
    loss.backward()
    expected = {name: (-p.grad / (p.grad.abs() + 1.0)).float()
                for name, p in model.named_parameters() if p.grad is not None}
    state = _critic(critic_dirs[family], ff.OptimizerConfig(**REFERENCE_STEP))
    before = _full(state)
    state, stats = ff.critic_step(state, batch, ff.CriticConfig(value_clip=None))
    after = _full(state)
    assert math.isclose(float(stats["loss"]), float(loss), rel_tol=1e-5, abs_tol=1e-6), (
        family, float(stats["loss"]), float(loss))
    assert set(expected) <= set(after), sorted(set(expected) - set(after))
    for name, delta in expected.items():
        torch.testing.assert_close(after[name] - before[name], delta, rtol=1e-4, atol=5e-6,
                                   msg=lambda m, name=name: f"{family} {name}: {m}")


def _full(state) -> dict[str, torch.Tensor]:
    from fsdpfn.testing.models import full_model_state

    return {k: v.clone() for k, v in full_model_state(state).items()}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("model_type", NO_CRITIC)
def test_a_verified_family_without_a_critic_class_is_refused_as_a_critic_by_name(model_type):
    spec = next(s for s in tiny_family_configs().values() if s["model_type"] == model_type)
    with pytest.raises(ConfigError) as err:
        ff.shard_model(ff.EngineConfig(model_config=spec, is_critic=True, dtype="float32",
                                       optimizer=None),
                       ff.build_mesh(ff.ParallelStrategy(), device_type="cpu"))
    msg = str(err.value)
    assert f"model_type: {model_type!r} is not supported as a critic" in msg, msg
    assert "token-classification" in msg and ", ".join(CRITIC_VERIFIED) in msg, msg
