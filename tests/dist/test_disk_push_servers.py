"""A disk push to several fsdpfn servers is all or nothing: every server loads, checks and stages
the files, and only then does each swap them in. A server that refuses (another model's shapes,
with the trainer's precheck off so that the refusal comes from the server itself) leaves every
server on the weights it served, whatever its place in the list; a push all accept lands on each
at the pushed version, serving the trainer's log-probs."""

from __future__ import annotations

import tempfile

import pytest
import torch

import fsdpfn as ff
from fsdpfn.testing import random_batch, run_spmd, save_tiny_model, tiny_qwen2_config

pytestmark = pytest.mark.dist

PROBE = [[5, 6, 7, 8, 9, 10]]


def _served(url):
    from fsdpfn.wire.http import call

    out = call(url, "/forward", {"input_ids": PROBE}, timeout=60)
    return out["weight_version"], out["token_logprobs"][0]


def _pushes(model_dir, good, bad, root):
    state = ff.shard_model(ff.EngineConfig(model_path=model_dir, dtype="float32",
                                           optimizer=ff.OptimizerConfig(lr=5e-2)),
                           ff.build_mesh(ff.ParallelStrategy(dp=-1), device_type="cpu"))
    refused = []
    for urls in ([good, bad], [bad, good]):
        before = _served(good)
        state, _ = ff.sft_step(state, random_batch(4, 12, seed=len(refused)))
        cfg = ff.PushConfig(transport="disk", disk_root=tempfile.mkdtemp(dir=root),
                            precheck=False, timeout_s=60)
        try:
            ff.push_weights(state, ff.RolloutTarget(urls, config=cfg))
            refused.append((None, before, _served(good)))
        except ff.WeightSyncError as exc:
            refused.append((str(exc), before, _served(good)))
    cfg = ff.PushConfig(transport="disk", disk_root=tempfile.mkdtemp(dir=root), timeout_s=60)
    receipt = ff.push_weights(state, ff.RolloutTarget([good], config=cfg))
    from tensordict import TensorDict

    batch = TensorDict({"input_ids": torch.tensor(PROBE),
                        "attention_mask": torch.ones(1, len(PROBE[0]), dtype=torch.bool)},
                       batch_size=[1])
    mine = ff.forward_logp(state, batch)["logp"][0].tolist()
    return refused, receipt.version, _served(good), mine


@pytest.mark.timeout(300)
def test_a_disk_push_one_server_refuses_leaves_every_server_as_it_was(tmp_path, spmd1):
    from fsdpfn.rollout import launch_server

    model_dir = str(save_tiny_model(tmp_path / "tiny", tiny_qwen2_config(), seed=0))
    other = str(save_tiny_model(tmp_path / "other", tiny_qwen2_config(intermediate_size=96),
                                seed=0))
    good = launch_server(model_dir, log_dir=tmp_path, health_timeout=120)
    bad = launch_server(other, log_dir=tmp_path, health_timeout=120)
    try:
        refused, version, served, mine = run_spmd(
            _pushes, 1, args=(model_dir, good.url, bad.url, str(tmp_path)), timeout=240,
            pool=spmd1)[0]
    finally:
        good.close()
        bad.close()
    for error, before, after in refused:
        assert error is not None and bad.url in error, error
        assert after == before  # the good server neither moved version nor changed weights
        assert "every server keeps the weights it served" in error, error
    assert served[0] == version
    torch.testing.assert_close(torch.tensor(served[1][1:]), torch.tensor(mine[1:]), atol=2e-4,
                               rtol=0)
