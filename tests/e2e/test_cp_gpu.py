"""GPU: context parallelism (Ulysses) over two GPUs (NCCL, flash varlen attention in bf16): the
log-probs and one ppo_step at cp=2 against cp=1 (dp=2) on the same global batch, with long and
short sequences (one shorter than cp), fewer kv heads than cp, and activation checkpointing.

Skipped without two CUDA devices. The test starts ``torchrun --nproc-per-node 2`` on this file:

    python -m pytest -q tests/e2e/test_cp_gpu.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="needs two CUDA devices (cp=2 over NCCL)")]

# float32 weights and compute: flash varlen is bf16-only, so fp32 takes the per-sequence SDPA
# path; cp=2 and cp=1 then differ by reduction order only
FP32_TOL = 1e-4
# bf16 compute on the flash varlen path: mean |difference| of log-probs, and the largest
BF16_MEAN_TOL, BF16_MAX_TOL = 2e-2, 0.5
LENGTHS = (3001, 1, 777, 4096, 2, 1500)  # pack of 9377 tokens: not a multiple of 2


def _batch():
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(0)
    T = max(LENGTHS)
    lens = torch.tensor(LENGTHS)
    attn = torch.arange(T)[None] < lens[:, None]
    ids = torch.where(attn, torch.randint(0, 4096, (len(LENGTHS), T), generator=g), 0)
    loss = attn.clone()
    loss[:, :1] = False
    adv = torch.where(loss, torch.randn(loss.shape, generator=g), 0)
    return TensorDict({"input_ids": ids, "attention_mask": attn, "loss_mask": loss,
                       "advantages": adv}, batch_size=[len(LENGTHS)])


def _state(cp: int, dtype: str, ac: bool):
    """lr=1 and eps=1 make AdamW's first update g / (|g| + 1): deltas compare gradients."""
    import fsdpfn as ff
    from fsdpfn.testing import tiny_qwen2_config

    # 8 query heads, 1 kv head: cp=2 replicates it
    cfg = tiny_qwen2_config(vocab_size=4096, hidden_size=256, intermediate_size=512,
                            num_hidden_layers=3, num_attention_heads=8,
                            num_key_value_heads=1).to_dict()
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=-1, cp=cp), device_type="cuda")
    config = ff.EngineConfig(model_config=cfg, dtype=dtype, gradient_checkpointing=ac,
                             mb_spec=ff.MicroBatchSpec(max_tokens_per_mb=6000),
                             optimizer=ff.OptimizerConfig(lr=1.0, eps=1.0, max_grad_norm=1.0))
    return ff.shard_model(config, mesh), mesh


def _full(state) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(state.model, options=StateDictOptions(full_state_dict=True,
                                                                      cpu_offload=True))


def _run(out_path: str) -> None:
    """On each of two ranks: forward_logp and one ppo_step at cp=1 and cp=2; rank 0 writes."""
    import torch.distributed as dist

    import fsdpfn as ff

    batch, report = _batch(), {}
    for dtype, ac in (("float32", False), ("bfloat16", True)):
        logps, deltas = {}, {}
        for cp in (1, 2):
            state, mesh = _state(cp, dtype, ac)
            local = ff.shard_batch(batch, mesh)
            local = ff.forward_logp(state, local, out_key="old_logp", with_entropy=True)
            logps[cp] = ff.gather_batch(local, mesh)["old_logp"]
            before = _full(state)
            state, stats = ff.ppo_step(state, local, ff.PPOConfig())
            after = _full(state)
            deltas[cp] = {k: (after[k] - before[k]).float() for k in after}
            report[f"{dtype}/cp{cp}/loss"] = float(stats["loss"])
            report[f"{dtype}/cp{cp}/grad_norm"] = float(stats["grad_norm"])
            del state
            torch.cuda.empty_cache()
        diff = (logps[2] - logps[1]).abs()
        report[f"{dtype}/logp_max"] = float(diff.max())
        report[f"{dtype}/logp_mean"] = float(diff[batch["attention_mask"]].mean())
        report[f"{dtype}/delta_rel"] = max(
            (float((deltas[2][k] - deltas[1][k]).norm() / (deltas[1][k].norm() + 1e-12))
             for k in deltas[1]), default=0.0)
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(report))


@pytest.mark.timeout(900)
def test_cp2_matches_cp1_on_two_gpus(tmp_path):
    out = tmp_path / "report.json"
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           __file__, str(out)], env=env, capture_output=True, text=True,
                          timeout=840)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    report = json.loads(out.read_text())
    assert report["float32/logp_max"] < FP32_TOL, report
    assert report["float32/delta_rel"] < 1e-3, report
    assert abs(report["float32/cp2/loss"] - report["float32/cp1/loss"]) < 1e-5, report
    assert report["bfloat16/logp_mean"] < BF16_MEAN_TOL, report
    assert report["bfloat16/logp_max"] < BF16_MAX_TOL, report
    assert report["bfloat16/delta_rel"] < 0.1, report


if __name__ == "__main__":  # a torchrun rank
    _run(sys.argv[1])
