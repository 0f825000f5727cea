"""load_checkpoint(weights_only=True) across optimizer_dtype: the weights cast to the state's.

A run trained with optimizer_dtype="bfloat16" keeps its weights in bf16, and the reference or
evaluation state a user builds next has the default float32 storage (or the other way round).
The weights alone load into it, cast to the state's dtype, with the checkpoint's checksums still
verified (the tensors are read in their saved dtype): bf16 -> float32 is exact, float32 -> bf16
is the saved value rounded to bf16. A full load (the optimizer's state) across optimizer_dtype
stays refused, and so does a weights load without weights_only=True, whose message names it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fsdpfn as ff
from fsdpfn.errors import CheckpointError
from fsdpfn.testing import random_batch, tiny_qwen2_config
from fsdpfn.testing.models import full_model_state

pytestmark = pytest.mark.dist


def _state(optimizer_dtype: str, *, trainable: bool = True):
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=-1), device_type="cpu")
    opt = ff.OptimizerConfig(lr=1e-2) if trainable else None
    return ff.shard_model(ff.EngineConfig(model_config=tiny_qwen2_config().to_dict(),
                                          dtype="float32", optimizer_dtype=optimizer_dtype,
                                          optimizer=opt, seed=4), mesh)


def _trained(optimizer_dtype: str, root: Path) -> dict:
    state = _state(optimizer_dtype)
    state, _ = ff.sft_step(state, random_batch(4, 10, seed=1), ff.SFTConfig())
    ff.save_checkpoint(state, root)
    return full_model_state(state)


def cast_loads(tmp: str):
    root = Path(tmp)
    out = {}
    for saved, here in (("bfloat16", "float32"), ("float32", "bfloat16")):
        weights = _trained(saved, root / saved)
        for trainable in (True, False):
            target = _state(here, trainable=trainable)
            try:
                ff.load_checkpoint(target, root / saved)
                refused = None
            except CheckpointError as exc:
                refused = str(exc)
            loaded, _ = ff.load_checkpoint(target, root / saved, weights_only=True)
            got = full_model_state(loaded)
            key = f"{saved}->{here}, {'trainable' if trainable else 'inference-only'}"
            out[key] = {
                "refused": refused,
                "dtypes": sorted({str(v.dtype) for v in got.values()}),
                "exact": all(torch.equal(got[n], weights[n].to(got[n].dtype)) for n in weights),
                "logp_finite": bool(ff.forward_logp(loaded, random_batch(2, 8, seed=2))
                                    ["logp"].isfinite().all()),
            }
    return out


@pytest.mark.timeout(240)
def test_weights_only_loads_cast_across_optimizer_dtype(spmd2, tmp_path):
    results = spmd2.run(cast_loads, args=(str(tmp_path),), timeout=200)
    rank0 = results[0]
    assert len(rank0) == 4, rank0
    for key, r in rank0.items():
        here = key.split("->")[1].split(",")[0]
        assert r["dtypes"] == [f"torch.{here}"], (key, r)
        assert r["exact"] and r["logp_finite"], (key, r)
        message = r["refused"]
        assert message is not None, (key, r)
        if "inference-only" in key:  # a weights load without weights_only: names it
            assert "dtype must be" in message or "inference-only" in message, (key, message)
            assert "weights_only=True" in message, (key, message)
        else:  # a full load across optimizer_dtype: the optimizer's class differs
            assert "optimizer.class" in message or "dtype must be" in message, (key, message)
    for r in results[1:]:
        assert all(v["refused"] == rank0[k]["refused"] for k, v in r.items()), (r, rank0)
