"""compute_scores: a reward model's sequence scores, the head at each row's last real token,
equal Hugging Face's own token-classification model (float64) on a saved directory; they are
what rw_step trains (its chosen/rejected score stats are their means), rows are independent of
their neighbours and padding, and the input batch is left as it was."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForTokenClassification, Qwen2Config

import fsdpfn as ff
from fsdpfn import keys as K
from fsdpfn.testing import random_batch, tiny_qwen2_config


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    config = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, num_labels=1)
    torch.manual_seed(3)
    model = AutoModelForTokenClassification.from_config(config)
    with torch.no_grad():
        model.score.weight.normal_(0.0, 0.5)  # a head far from zero, so scores differ by row
    path = tmp_path_factory.mktemp("rm")
    model.save_pretrained(path)
    return path


def _critic(path, optimizer=None):
    mesh = ff.build_mesh(ff.ParallelStrategy(), device_type="cpu")
    return ff.shard_model(ff.EngineConfig(model_path=str(path), is_critic=True, dtype="float32",
                                          optimizer=optimizer), mesh)


def _reference(path, batch) -> torch.Tensor:
    """float64, one row at a time without padding: HF's head at the row's last token."""
    model = AutoModelForTokenClassification.from_pretrained(path, torch_dtype=torch.float64)
    out = []
    with torch.no_grad():
        for ids, attn in zip(batch[K.INPUT_IDS], batch[K.ATTENTION_MASK]):
            n = int(attn.sum())
            out.append(model(input_ids=ids[None, :n]).logits[0, n - 1, 0])
    return torch.stack(out)


def test_scores_equal_the_models_own_head_at_the_last_token(reward_model_dir):
    state = _critic(reward_model_dir)
    batch = random_batch(5, 24, seed=8, min_len=3)
    before = batch.clone()
    out = ff.compute_scores(state, batch)
    assert out["scores"].shape == (5,) and out["scores"].dtype == torch.float32
    ref = _reference(reward_model_dir, batch)
    assert float((out["scores"].double() - ref).abs().max()) <= 1e-5, (out["scores"], ref)
    assert ref.std() > 1e-2  # the rows' scores differ: the check can tell rows apart
    assert set(batch.keys()) == set(before.keys())
    assert all(torch.equal(batch[k], before[k]) for k in before.keys())
    # a row alone, wider padding, other rows beside it: the same score
    alone = ff.compute_scores(state, batch[1:2], out_key="rm")["rm"]
    assert torch.allclose(alone, out["scores"][1:2], atol=1e-6)


def test_rw_step_trains_these_scores(reward_model_dir):
    state = _critic(reward_model_dir, optimizer=ff.OptimizerConfig(lr=1e-3))
    batch = random_batch(6, 20, seed=4, min_len=3)
    scores = ff.compute_scores(state, batch)["scores"]
    state, stats = ff.rw_step(state, batch)
    assert abs(float(stats["chosen_score"]) - float(scores[0::2].mean())) <= 1e-5
    assert abs(float(stats["rejected_score"]) - float(scores[1::2].mean())) <= 1e-5
    after = ff.compute_scores(state, batch)["scores"]
    # one step of Bradley-Terry moves the margins the way the loss asks
    assert float((after[0::2] - after[1::2]).mean()) > float((scores[0::2] - scores[1::2]).mean())


def test_compute_scores_refuses_an_actor_and_an_input_key(reward_model_dir):
    mesh = ff.build_mesh(ff.ParallelStrategy(), device_type="cpu")
    actor = ff.shard_model(ff.EngineConfig(model_config=tiny_qwen2_config().to_dict(),
                                           dtype="float32", optimizer=None), mesh)
    batch = random_batch(2, 10, seed=1)
    with pytest.raises(ff.ConfigError, match="compute_scores"):
        ff.compute_scores(actor, batch)
    with pytest.raises(ff.ConfigError, match="out_key"):
        ff.compute_scores(_critic(reward_model_dir), batch, out_key=K.INPUT_IDS)
