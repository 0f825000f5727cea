"""GPU: NCCL weight push from a CUDA trainer (GPU 0) to a rollout server on GPU 1.

Skipped without 2 CUDA GPUs (NCCL cannot put two members of a group on one GPU). The trainer runs
in its own process (``python tests/e2e/test_weights_gpu.py trainer ...``, a one-rank job on
cuda:0 with the cpu:gloo,cuda:nccl default group); the server is ``python -m fsdpfn.rollout``
with CUDA_VISIBLE_DEVICES=1. Prints timings of broadcast and disk pushes.

    python -m pytest -q -s tests/e2e/test_weights_gpu.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# bfloat16 (the trainer's varlen attention on CUDA needs bf16/fp16). The pushed weights are
# bit-identical (the push compares checksums); the server runs HF sdpa, the trainer its packed
# attention, both with bf16 compute: per-token log-probs differ by bf16 rounding (~1e-2).
BF16_TOL = 0.1

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    torch.cuda.device_count() < 2,
    reason="needs 2 CUDA GPUs: the trainer on one, the rollout server on the other")]

QWEN2_1_5B = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                  num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                  max_position_embeddings=4096, tie_word_embeddings=True)


def trainer(model_dir: str, url: str, dtype: str, n_pushes: int, disk_root: str, out: str):
    from tensordict import TensorDict

    import fsdpfn as ff
    from fsdpfn.weights import PushConfig, RolloutTarget, push_weights
    from fsdpfn.wire.http import call

    torch.cuda.set_device(0)
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=1), device_type="cuda")
    state = ff.shard_model(ff.EngineConfig(model_path=model_dir, dtype=dtype,
                                           optimizer=ff.OptimizerConfig(lr=1e-3)), mesh)
    g = torch.Generator().manual_seed(0)
    V = state.hf_config.vocab_size
    ids = torch.randint(0, V, (4, 64), generator=g)
    attn = torch.ones(4, 64, dtype=torch.bool)
    loss = attn.clone()
    loss[:, :8] = False
    batch = TensorDict({"input_ids": ids, "attention_mask": attn, "loss_mask": loss},
                       batch_size=[4]).to("cuda")
    state, _ = ff.sft_step(state, batch, ff.SFTConfig())
    target = RolloutTarget(url, config=PushConfig(timeout_s=120))
    seconds = [push_weights(state, target).seconds for _ in range(n_pushes)]
    receipt = push_weights(state, target)
    probe = ids[:2, :32]
    served = call(url, "/forward", {"input_ids": probe.tolist()}, timeout=60)
    ours = ff.forward_logp(state, TensorDict(
        {"input_ids": probe, "attention_mask": torch.ones_like(probe, dtype=torch.bool)},
        batch_size=[2]).to("cuda"))["logp"].cpu()
    diff = float((torch.tensor(served["token_logprobs"]) - ours)[:, 1:].abs().max())
    # a NaN in the pushed weights: refused after every byte arrived (the server had already
    # pointed its parameters at them, then points them back); the served model is unchanged
    param = dict(state.model.named_parameters())["lm.model.norm.weight"]
    # this rank's shard (all of it at dp=1), through .data: its own version counter, so the
    # state is not marked as changed behind fsdpfn's back
    param = getattr(param, "_local_tensor", param).data
    kept = param.clone()
    with torch.no_grad():
        param.view(-1)[0] = float("nan")
    try:
        push_weights(state, target)
        nan_error = None
    except ff.WeightSyncError as exc:
        nan_error = str(exc)
    with torch.no_grad():
        param.copy_(kept)
    again = call(url, "/forward", {"input_ids": probe.tolist()}, timeout=60)
    unchanged = again["token_logprobs"] == served["token_logprobs"] and \
        again["weight_version"] == served["weight_version"]
    push_weights(state, target)  # and the next push goes through
    disk = push_weights(state, RolloutTarget(url, config=PushConfig(
        transport="disk", disk_root=disk_root, timeout_s=300)))
    version = call(url, "/weight_version", timeout=10)["weight_version"]
    result = {"broadcast_seconds": seconds, "n_bytes": receipt.n_bytes,
              "n_tensors": receipt.n_tensors, "version": state.version,
              "served_version": version, "logp_max_diff": diff, "disk_seconds": disk.seconds,
              "nan_error": nan_error, "unchanged_after_nan": unchanged,
              "apply_s": target.last_apply_s}
    Path(out).write_text(json.dumps(result))


def slow_trainer(model_dir: str, url: str, out: str):
    """A push whose trainer stalls for 4 s after its first bucket: the server takes the model
    only for the swap, once every byte arrived, so a generation meanwhile runs at once on the
    old weights; the push then lands."""
    import threading
    import time

    from tensordict import TensorDict

    import fsdpfn as ff
    from fsdpfn.weights import PushConfig, RolloutTarget, push_weights
    from fsdpfn.wire.http import call

    torch.cuda.set_device(0)
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=1), device_type="cuda")
    state = ff.shard_model(ff.EngineConfig(model_path=model_dir, dtype="bfloat16",
                                           optimizer=ff.OptimizerConfig(lr=1e-3)), mesh)
    ids = torch.randint(0, state.hf_config.vocab_size, (2, 32),
                        generator=torch.Generator().manual_seed(1))
    loss = torch.ones_like(ids, dtype=torch.bool)
    loss[:, :4] = False
    batch = TensorDict({"input_ids": ids, "attention_mask": torch.ones_like(ids, dtype=torch.bool),
                        "loss_mask": loss}, batch_size=[2]).to("cuda")
    result, armed = {}, []

    def generate():
        start = time.monotonic()
        answer = call(url, "/generate", {"input_ids": [[1, 2, 3]], "sampling_params": {
            "max_new_tokens": 4, "temperature": 0}, "return_format": "fsdpfn"}, timeout=60)
        result.update(gen_version=answer["weight_version"], gen_done=time.monotonic(),
                      gen_seconds=time.monotonic() - start)

    def on_bucket(index, n_buckets):
        if armed and index == 0:  # the other buckets stay outstanding for 4 s
            time.sleep(0.3)  # by now the server waits for the bytes
            threading.Thread(target=generate, daemon=True).start()
            time.sleep(3.7)

    target = RolloutTarget(url, config=PushConfig(timeout_s=60, bucket_bytes=64 << 10,
                                                  edge_bucket_bytes=None, on_bucket=on_bucket))
    first = push_weights(state, target)  # sets up the group and the channel (version 0)
    call(url, "/generate", {"input_ids": [[1, 2, 3]], "sampling_params": {
        "max_new_tokens": 4, "temperature": 0}}, timeout=120)  # warm
    state, _ = ff.sft_step(state, batch, ff.SFTConfig())
    armed.append(True)
    receipt = push_weights(state, target)
    plan = next(iter(target._plans.values()))[1]  # noqa: SLF001
    result.update(push_done=time.monotonic(), n_buckets=len(plan),
                  first_version=first.version, version=receipt.version,
        served_version=call(url, "/weight_version", timeout=10)["weight_version"])
    Path(out).write_text(json.dumps(result))


def _against_server(tmp_path, config, dtype: str, *args: str) -> dict:
    """Serve a fresh model of ``config`` on GPU 1, run ``python THIS_FILE args...`` (a trainer on
    GPU 0, its model dir, the server's url and the result path appended) and return its result."""
    from fsdpfn.rollout import launch_server
    from fsdpfn.testing import save_tiny_model

    model_dir = save_tiny_model(tmp_path / "model", config, seed=0)
    out = tmp_path / "result.json"
    server = launch_server(model_dir, device="cuda", dtype=dtype, threads=4,
                           log_dir=tmp_path, health_timeout=300,
                           env={"CUDA_VISIBLE_DEVICES": "1"})
    try:
        proc = subprocess.run(
            [sys.executable, __file__, args[0], str(model_dir), server.url, *args[1:], str(out)],
            env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"}, capture_output=True, text=True,
            timeout=480)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:] + server.log()
    finally:
        server.close()
    result = json.loads(out.read_text())
    print(json.dumps(result))
    return result


def _run(tmp_path, config, dtype: str, n_pushes: int) -> dict:
    result = _against_server(tmp_path, config, dtype, "trainer", dtype, str(n_pushes),
                             str(tmp_path / "disk"))
    assert result["served_version"] == result["version"] == 1
    assert result["nan_error"] is not None and "must be finite" in result["nan_error"]
    assert result["unchanged_after_nan"]
    return result


@pytest.mark.timeout(600)
def test_nccl_push_tiny_bfloat16(tmp_path):
    from fsdpfn.testing import tiny_qwen2_config

    result = _run(tmp_path, tiny_qwen2_config(), "bfloat16", 2)
    assert result["logp_max_diff"] < BF16_TOL


@pytest.mark.timeout(900)
def test_nccl_push_qwen2_1_5b_bfloat16(tmp_path):
    from fsdpfn.testing import tiny_qwen2_config

    result = _run(tmp_path, tiny_qwen2_config(**QWEN2_1_5B), "bfloat16", 3)
    assert result["n_bytes"] > 3e9 and result["logp_max_diff"] < BF16_TOL


@pytest.mark.timeout(600)
def test_nccl_push_from_a_stalled_trainer_lets_generation_run(tmp_path):
    from fsdpfn.testing import tiny_qwen2_config

    result = _against_server(tmp_path, tiny_qwen2_config(), "bfloat16", "slow_trainer")
    assert result["n_buckets"] > 1
    assert result["first_version"] == 0 and result["version"] == result["served_version"] == 1
    # the generation asked 0.3 s into the stall ran on the weights the server had before, and
    # did not wait for the push to end
    assert result["gen_version"] == 0 and result["gen_done"] < result["push_done"]
    assert result["gen_seconds"] < 3.0


if __name__ == "__main__" and sys.argv[1] == "trainer":
    trainer(*sys.argv[2:5], int(sys.argv[5]), *sys.argv[6:8])
if __name__ == "__main__" and sys.argv[1] == "slow_trainer":
    slow_trainer(*sys.argv[2:5])
