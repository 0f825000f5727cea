"""Ranks that differ only in their tp or cp coordinate must pass identical rows, and a batch
that differs is refused on every rank naming the keys that differ.

The check compared a position-weighted sum of input_ids and attention_mask alone: a change
that kept the sum (+2 on one token, -1 on the next) went through, and so did another
loss_mask or negated advantages on one rank, each rank then training on its own rows and
reporting its own loss. Every key's bytes are compared now (fsdpfn.wire.checksum).
"""

from __future__ import annotations

import pytest
import torch

import fsdpfn as ff
from fsdpfn import keys as K
from fsdpfn.errors import BatchError
from fsdpfn.testing import random_batch, tiny_qwen2_config

pytestmark = pytest.mark.dist


def _diverging(tp, cp, change):
    import torch.distributed as dist

    mesh = ff.build_mesh(ff.ParallelStrategy(dp=1, tp=tp, cp=cp), device_type="cpu")
    state = ff.shard_model(ff.EngineConfig(model_config=tiny_qwen2_config().to_dict(),
                                           dtype="float32", optimizer=ff.OptimizerConfig()),
                           mesh)
    batch = random_batch(4, 16, seed=3, min_len=8)
    batch[K.INPUT_IDS][0, :2] = 10
    batch.set(K.OLD_LOGP, ff.forward_logp(state, batch)[K.LOGP])
    batch.set(K.ADVANTAGES, torch.linspace(-1, 1, 64).view(4, 16) * batch[K.ATTENTION_MASK])
    mine = batch.clone()
    if dist.get_rank() == 1:
        if change == "ids":  # the old sum's blind spot (weights 1, 2): +2 at t=0, -1 at t=1
            mine[K.INPUT_IDS][0, 0] += 2
            mine[K.INPUT_IDS][0, 1] -= 1
        else:
            mine.set(K.ADVANTAGES, -mine[K.ADVANTAGES])
    try:
        ff.ppo_step(state, mine, ff.PPOConfig())
        refused = None
    except BatchError as exc:
        refused = str(exc)
    _, stats = ff.ppo_step(state, batch, ff.PPOConfig())  # the state is live and unchanged
    return refused, float(stats["loss"])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tp,cp", [(2, 1), (1, 2)], ids=["tp2", "cp2"])
@pytest.mark.parametrize("change,key", [("ids", "input_ids"), ("advantages", "advantages")])
def test_ranks_of_one_tp_or_cp_group_passing_other_rows_are_refused(spmd2, tp, cp, change, key):
    results = spmd2.run(_diverging, args=(tp, cp, change), timeout=200)
    axis = "tp" if tp > 1 else "cp"
    for refused, _ in results:
        assert refused is not None and refused.startswith(
            "batch: ranks of one ") and f"on its 2 {axis} ranks: the values of ['{key}'] " \
            "differ" in refused, refused
    assert results[0][1] == results[1][1]
