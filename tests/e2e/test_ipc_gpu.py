"""GPU: a weight push over CUDA IPC to a rollout server on the trainer's own GPU.

Skipped without CUDA. The server is ``python -m fsdpfn.rollout`` on GPU 0 and the trainer a
one-rank job on the same GPU (``python tests/e2e/test_ipc_gpu.py trainer ...``): NCCL cannot
connect the two, so the push hands the server CUDA IPC handles. Checks: the served version and
checksum equal the pushed ones (the push verifies), the served log-probs match the trainer's in
bf16, a NaN is refused with the served weights kept, so are bytes whose checksum is not the
sender's (refused before the swap), and the next push lands; prints the IPC and
disk push times of a Qwen2-1.5B shape.

    python -m pytest -q -s tests/e2e/test_ipc_gpu.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BF16_TOL = 0.1  # served (HF sdpa) against trainer (packed attention) log-probs, both bf16

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: CUDA IPC between two processes")]

QWEN2_1_5B = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                  num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                  max_position_embeddings=4096, tie_word_embeddings=True)


def trainer(model_dir: str, url: str, disk_root: str, out: str):
    from tensordict import TensorDict

    import fsdpfn as ff
    from fsdpfn.weights import PushConfig, RolloutTarget, push_weights
    from fsdpfn.wire.http import call

    torch.cuda.set_device(0)
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=1), device_type="cuda")
    state = ff.shard_model(ff.EngineConfig(model_path=model_dir, dtype="bfloat16",
                                           optimizer=ff.OptimizerConfig(lr=1e-3)), mesh)
    ids = torch.randint(0, state.hf_config.vocab_size, (4, 64),
                        generator=torch.Generator().manual_seed(0))
    attn = torch.ones(4, 64, dtype=torch.bool)
    loss = attn.clone()
    loss[:, :8] = False
    batch = TensorDict({"input_ids": ids, "attention_mask": attn, "loss_mask": loss},
                       batch_size=[4]).to("cuda")
    state, _ = ff.sft_step(state, batch, ff.SFTConfig())
    target = RolloutTarget(url, config=PushConfig(transport="ipc", timeout_s=120))
    seconds = [push_weights(state, target).seconds for _ in range(3)]
    probe = ids[:2, :32]
    served = call(url, "/forward", {"input_ids": probe.tolist()}, timeout=60)
    ours = ff.forward_logp(state, TensorDict(
        {"input_ids": probe, "attention_mask": torch.ones_like(probe, dtype=torch.bool)},
        batch_size=[2]).to("cuda"))["logp"].cpu()
    diff = float((torch.tensor(served["token_logprobs"]) - ours)[:, 1:].abs().max())
    param = dict(state.model.named_parameters())["lm.model.norm.weight"]
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
    unchanged = again["token_logprobs"] == served["token_logprobs"]
    # bytes that arrive other than sent (here: the sender's checksum off by one) are refused
    # by the server before its swap, not found by the trainer after it
    from fsdpfn.weights.channel import SentChecksums

    state, _ = ff.sft_step(state, batch, ff.SFTConfig())  # weights the server does not hold
    value = SentChecksums.value
    SentChecksums.value = lambda self: value(self) + 1
    try:
        push_weights(state, target)
        checksum_error = None
    except ff.WeightSyncError as exc:
        checksum_error = str(exc)
    finally:
        SentChecksums.value = value
    after = call(url, "/forward", {"input_ids": probe.tolist()}, timeout=60)
    unchanged_after_checksum = after["token_logprobs"] == served["token_logprobs"]
    receipt = push_weights(state, target)
    disk = push_weights(state, RolloutTarget(url, config=PushConfig(
        transport="disk", disk_root=disk_root, timeout_s=300)))
    version = call(url, "/weight_version", timeout=10)["weight_version"]
    Path(out).write_text(json.dumps({
        "ipc_seconds": seconds, "disk_seconds": disk.seconds, "n_bytes": receipt.n_bytes,
        "version": state.version, "served_version": version, "logp_max_diff": diff,
        "nan_error": nan_error, "unchanged_after_nan": unchanged,
        "checksum_error": checksum_error, "unchanged_after_checksum": unchanged_after_checksum}))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("shape", ["tiny", "qwen2_1.5b"])
def test_ipc_push_to_a_server_on_the_same_gpu(tmp_path, shape):
    from fsdpfn.rollout import launch_server
    from fsdpfn.testing import save_tiny_model, tiny_qwen2_config

    # the GPU is shared by three processes here (this one, the server, the trainer): what the
    # tests before this one left cached in this process goes back first (34 GiB on an 80 GiB
    # card ran the 1.5B trainer out of memory)
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    config = tiny_qwen2_config(**(QWEN2_1_5B if shape != "tiny" else {}))
    model_dir = save_tiny_model(tmp_path / "model", config, seed=0)
    out = tmp_path / "result.json"
    # the server's cache sized as the RL recipes size it (rows of the step), not its default
    # half of the free memory: the trainer shares the GPU (on an 80 GB card the default 38 GB
    # of KV cache ran the 1.5B trainer's fp32 state out of memory)
    server = launch_server(model_dir, device="cuda", dtype="bfloat16", threads=4,
                           log_dir=tmp_path, health_timeout=300,
                           extra_args=("--decode-rows", "64", "--decode-max-len", "256"),
                           env={"CUDA_VISIBLE_DEVICES": "0"})
    try:
        proc = subprocess.run([sys.executable, __file__, "trainer", str(model_dir), server.url,
                               str(tmp_path / "disk"), str(out)],
                              env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"},
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:] + server.log()
    finally:
        server.close()
    result = json.loads(out.read_text())
    print(json.dumps(result))
    assert result["served_version"] == result["version"]
    assert result["logp_max_diff"] < BF16_TOL
    assert result["nan_error"] is not None and "must be finite" in result["nan_error"]
    assert result["unchanged_after_nan"]
    assert result["checksum_error"] is not None and \
        "weights_checksum: what arrived must have the sender's checksum" in \
        result["checksum_error"], result["checksum_error"]
    assert result["unchanged_after_checksum"]


if __name__ == "__main__" and sys.argv[1] == "trainer":
    trainer(*sys.argv[2:6])
