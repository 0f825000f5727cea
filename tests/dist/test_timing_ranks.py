"""Timing numbers on several ranks: identical on every rank (the slowest rank's stage split, the
largest peak), still adding up within the wall time, tokens counted once per data-parallel
rank whatever the tp layout; forward-only numbers and a push's split the same way."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import fsdpfn as ff
from fsdpfn import keys as K
from fsdpfn.engine import timing
from fsdpfn.testing import random_batch, tiny_qwen2_config

STAGE_KEYS = [f"time_{s}" for s in timing.STAGES]


def _global_batch():
    return random_batch(8, 12, seed=7)


def timing_on_ranks(dp: int, tp: int, push_root: str) -> dict:
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=dp, tp=tp), device_type="cpu")
    cfg = ff.EngineConfig(model_config=tiny_qwen2_config().to_dict(), dtype="float32",
                          mb_spec=ff.MicroBatchSpec(max_tokens_per_mb=40), peak_tflops=1.0)
    state = ff.shard_model(cfg, mesh)
    batch = ff.shard_batch(_global_batch(), mesh)
    # a slower rank 1 (ranks differ): the numbers must still agree everywhere
    if dist.get_rank() == 1:
        torch.manual_seed(0)
        torch.randn(400, 400) @ torch.randn(400, 400)
    state, stats = ff.sft_step(state, batch)
    out = ff.forward_logp(state, batch)
    receipt = ff.push_weights(state, ff.DiskTarget(push_root))
    return {"stats": {k: float(v) for k, v in stats.items()},
            "forward": ff.last_timings(state)["forward_logp"],
            "keys_out": sorted(out.keys()), "keys_in": sorted(batch.keys()),
            "push": (receipt.seconds, receipt.gather_s, receipt.transfer_s)}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dp,tp", [(2, 1), (1, 2)])
def test_numbers_identical_on_all_ranks_and_adding_up(spmd2, tmp_path, dp, tp):
    results = spmd2.run(timing_on_ranks, args=(dp, tp, str(tmp_path / "w")), timeout=240)
    real = float(_global_batch()[K.ATTENTION_MASK].sum())
    for res in results:
        for what in ("stats", "forward"):
            numbers = res[what]
            assert numbers == results[0][what], what
            stages = sum(numbers[k] for k in STAGE_KEYS)
            assert 0 < stages <= numbers["time_total"] * (1 + 1e-5), numbers
            # every real token once, not once per tp replica
            assert numbers["tokens_per_s"] * numbers["time_total"] == pytest.approx(real,
                                                                                   rel=1e-5)
            assert numbers["mfu"] > 0 and numbers["peak_memory_gb"] > 0
        assert set(res["keys_out"]) == set(res["keys_in"]) | {"logp"}
        seconds, gather, transfer = res["push"]
        assert gather > 0 and gather + transfer == pytest.approx(seconds)
