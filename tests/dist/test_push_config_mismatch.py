"""A push to a server whose model has the trainer's tensor names, shapes and dtype but another
family or config is refused before any byte is sent (the precheck compares model_type and the
config fingerprint of fsdpfn.wire.model_fingerprint): a Llama of rope_theta 1e4 pushed to a Llama
of rope_theta 1e6, a Llama pushed to a Mistral with a sliding window. Each refusal names the field
and both values, and the server keeps its version and weights; the same weights would otherwise
be served computing other log-probs (up to 0.47 nats apart in the audit that found it). Two model
directories of one config still push, and ``precheck=False`` skips the check as documented.

CPU trainer rank (gloo) and a real rollout server subprocess (fsdpfn.rollout.launch_server) of
tiny configs built here; nothing is downloaded.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

import fsdpfn as ff
from fsdpfn.rollout import launch_server
from fsdpfn.testing import random_batch, save_tiny_model, tiny_llama_config
from fsdpfn.wire.http import call

pytestmark = pytest.mark.dist

PROBE = [[(3 + 7 * i) % 128 for i in range(24)]]


def _llama(rope_theta: float):
    return tiny_llama_config(rope_theta=rope_theta)


def _mistral():
    """tiny_llama_config's shapes (same tensor names too) as a Mistral of window 4."""
    from transformers import MistralConfig

    return MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
                         rms_norm_eps=1e-6, sliding_window=4)


def _served(url: str) -> tuple[int, list[float]]:
    out = call(url, "/forward", {"input_ids": PROBE}, timeout=60)
    return out["weight_version"], out["token_logprobs"][0]


def train_and_push(model_dir: str, url: str, pushes: list[dict]):
    """Rank fn: one sft_step (the weights then differ from any server's), then each push of
    ``pushes`` (PushConfig kwargs) in turn; returns [(receipt version or None, error or None)]
    and the trainer's log-probs on PROBE."""
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=-1), device_type="cpu")
    state = ff.shard_model(ff.EngineConfig(model_path=model_dir, dtype="float32",
                                           optimizer=ff.OptimizerConfig(lr=1e-2)), mesh)
    state, _ = ff.sft_step(state, random_batch(4, 12, seed=0))
    results = []
    for kwargs in pushes:
        target = ff.RolloutTarget(url, config=ff.PushConfig(timeout_s=60, **kwargs))
        try:
            results.append((ff.push_weights(state, target).version, None))
        except ff.WeightSyncError as exc:
            results.append((None, str(exc)))
        finally:
            target.close()
    ids = torch.tensor(PROBE)
    batch = TensorDict({"input_ids": ids, "attention_mask": torch.ones_like(ids, dtype=torch.bool)},
                       batch_size=[1])
    return results, ff.forward_logp(state, batch)["logp"][0].tolist()


@pytest.mark.timeout(300)
def test_a_push_to_a_server_of_another_rope_theta_is_refused_naming_it(spmd1, tmp_path):
    trainer = str(save_tiny_model(tmp_path / "trainer", _llama(1e4), seed=0))
    served = str(save_tiny_model(tmp_path / "served", _llama(1e6), seed=1))
    pushes = [{}, {"transport": "disk", "disk_root": str(tmp_path / "disk")},
              {"precheck": False}]
    with launch_server(served, dtype="float32", log_dir=tmp_path) as server:
        before = _served(server.url)
        (channel, disk), mine = spmd1.run(
            train_and_push, args=(trainer, server.url, pushes[:2]), timeout=240)[0]
        after = _served(server.url)
        (unchecked,), _ = spmd1.run(train_and_push, args=(trainer, server.url, pushes[2:]),
                                    timeout=240)[0]
        pushed = _served(server.url)
    for version, error in (channel, disk):
        assert version is None
        assert f"server {server.url}" in error
        assert ("config.rope_parameters.rope_theta must equal the trainer's 10000, "
                "got 1000000") in error
        assert "HTTP" not in error  # refused by the trainer, before any request to update
    assert after == before  # version 0 and bit-identical log-probs: the weights were kept
    # precheck=False skips the check (as documented): the push lands, and the served model,
    # with its own rope_theta, computes other log-probs than the trainer for the same weights
    assert unchecked == (1, None)
    assert pushed[0] == 1
    gap = max(abs(a - b) for a, b in zip(pushed[1][1:], mine[1:]))
    assert gap > 1e-4


@pytest.mark.timeout(300)
def test_a_llama_push_to_a_mistral_server_is_refused_naming_model_type(spmd1, tmp_path):
    trainer = str(save_tiny_model(tmp_path / "trainer", _llama(1e4), seed=0))
    served = str(save_tiny_model(tmp_path / "served", _mistral(), seed=1))
    # without an update channel the push would go in SGLang's protocol: checked all the same
    with launch_server(served, dtype="float32", log_dir=tmp_path,
                       extra_args=("--no-channel",)) as server:
        info = call(server.url, "/get_model_info", timeout=30)
        before = _served(server.url)
        ((version, error),), _ = spmd1.run(train_and_push, args=(trainer, server.url, [{}]),
                                           timeout=240)[0]
        after = _served(server.url)
    assert version is None
    assert "config.model_type must equal the trainer's 'llama', got 'mistral'" in error
    assert "config.sliding_window: the served model's config has 4, the trainer's has none" \
        in error
    assert after == before
    assert info["model_type"] == "mistral" and info["config_fields"]["sliding_window"] == 4


@pytest.mark.timeout(300)
def test_two_model_dirs_of_one_config_still_push(spmd1, tmp_path):
    trainer = str(save_tiny_model(tmp_path / "trainer", _llama(1e6), seed=0))
    served = str(save_tiny_model(tmp_path / "served", _llama(1e6), seed=1))
    pushes = [{}, {"transport": "disk", "disk_root": str(tmp_path / "disk")}]
    with launch_server(served, dtype="float32", log_dir=tmp_path) as server:
        results, mine = spmd1.run(train_and_push, args=(trainer, server.url, pushes),
                                  timeout=240)[0]
        version, got = _served(server.url)
    assert results == [(1, None), (1, None)]
    assert version == 1
    torch.testing.assert_close(torch.tensor(got[1:]), torch.tensor(mine[1:]), atol=1e-5, rtol=0)
