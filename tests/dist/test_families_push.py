"""After a push, the built-in server serves each family exactly: a trainer trains one step (so its
weights differ from the server's), pushes over the update channel, and the server's teacher-forced
log-probs (its own HF model, eager, float32) equal the trainer's forward_logp, rows past every
window. The families whose layout differs most: tied heads, softcaps, fused projections, q/k
norms, windows, rope scaling.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict

import fsdpfn as ff
from fsdpfn import keys as K
from fsdpfn.rollout import launch_server
from fsdpfn.testing.models import save_family_model, tiny_family_configs
from fsdpfn.weights import RolloutTarget, push_weights
from fsdpfn.wire.http import call

pytestmark = pytest.mark.dist

FAMILIES = ["gemma2", "gemma3_text", "phi3", "olmo2", "qwen2-sliding", "llama-rope-yarn"]
ROWS = [list(range(3, 43)), list(range(50, 81))]  # 40 and 31 tokens: past every 12-token window


def _batch() -> TensorDict:
    T = max(map(len, ROWS))
    ids = torch.zeros(len(ROWS), T, dtype=torch.long)
    attn = torch.zeros(len(ROWS), T, dtype=torch.bool)
    for i, r in enumerate(ROWS):
        ids[i, :len(r)] = torch.tensor(r)
        attn[i, :len(r)] = True
    loss = attn.clone()
    loss[:, :2] = False
    return TensorDict({K.INPUT_IDS: ids, K.ATTENTION_MASK: attn, K.LOSS_MASK: loss},
                      batch_size=[len(ROWS)])


def train_push_and_score(model_dir: str, url: str):
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=-1), device_type="cpu")
    state = ff.shard_model(ff.EngineConfig(model_path=model_dir, dtype="float32",
                                           optimizer=ff.OptimizerConfig(lr=1e-2)), mesh)
    state, _ = ff.sft_step(state, _batch(), ff.SFTConfig())
    target = RolloutTarget(url)
    receipt = push_weights(state, target)
    target.close()
    mine = ff.forward_logp(state, _batch(), out_key=K.LOGP)[K.LOGP]
    return receipt.version, [mine[i, :len(r)].tolist() for i, r in enumerate(ROWS)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("family", FAMILIES)
def test_the_server_serves_pushed_weights_exactly(family, spmd1, tmp_path):
    spec = tiny_family_configs()[family]
    model_dir = str(save_family_model(tmp_path / family, spec, seed=4))
    with launch_server(model_dir, dtype="float32", log_dir=tmp_path) as server:
        before = call(server.url, "/forward", {"input_ids": ROWS}, timeout=60)
        version, mine = spmd1.run(train_push_and_score, args=(model_dir, server.url),
                                  timeout=200)[0]
        served = call(server.url, "/forward", {"input_ids": ROWS}, timeout=60)
    assert served["weight_version"] == version
    for got, want, old in zip(served["token_logprobs"], mine, before["token_logprobs"]):
        got, want, old = (torch.tensor(x, dtype=torch.float64) for x in (got, want, old))
        assert (got - old).abs().max() > 1e-3  # the push changed what the server computes
        torch.testing.assert_close(got[1:], want[1:], atol=1e-5, rtol=0)
