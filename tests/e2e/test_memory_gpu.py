"""GPU: the memory options on one CUDA device.

* ``fsdp.per_layer_optim_step``: parameters and Adam moments equal fused AdamW's (fp32 master
  weights) and KahanAdamW's (bf16) after several clipped steps on the same gradients, within one
  ulp, and grad_step trains with it; the state lives
  in pinned host memory, and the device's peak during the step is at most the prefetch window of
  units' state (plus slack);
* ``fsdp.offload_params``: trains on CUDA with gradient clipping (parameters, gradients and the
  CPU AdamW step on the host), tracks the default run, and a checkpoint round-trips;
* checkpoints round-trip with the per-layer step, alone and with offload_params;
* compiled blocks (``compile=True``) train with the per-layer step as with the default
  optimizer: the same losses over three clipped steps, within bf16's rounding.

Skipped without CUDA.

    python -m pytest -q tests/e2e/test_memory_gpu.py
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from tensordict import TensorDict

import fsdpfn as ff
from fsdpfn import keys as K
from fsdpfn.checkpoint import load_checkpoint, save_checkpoint
from fsdpfn.testing import tiny_qwen2_config

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs CUDA: streams, pinned memory "
                                                         "and FSDP2's CPU offload on a device")]

OPT = ff.OptimizerConfig(lr=1e-3, schedule="cosine", warmup_steps=1, total_steps=8,
                         weight_decay=0.1, max_grad_norm=0.1)  # every step clipped
V = 8192


def _model_config() -> dict:
    return tiny_qwen2_config(vocab_size=V, hidden_size=512, intermediate_size=1536,
                             num_hidden_layers=6, num_attention_heads=8,
                             num_key_value_heads=2).to_dict()


def _state(optimizer_dtype="float32", seed=1, compile=False, **fsdp):
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=-1), device_type="cuda")
    config = ff.EngineConfig(model_config=_model_config(), dtype="bfloat16",
                             optimizer_dtype=optimizer_dtype, optimizer=OPT, seed=seed,
                             compile=compile, fsdp=ff.FSDPConfig(**fsdp))
    return ff.shard_model(config, mesh)


def _batch(seed, B=8, T=256):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(T // 2, T + 1, (B,), generator=g)
    attn = torch.arange(T)[None] < lens[:, None]
    loss = attn.clone()
    loss[:, :16] = False
    return TensorDict({K.INPUT_IDS: torch.randint(0, V, (B, T), generator=g),
                       K.ATTENTION_MASK: attn, K.LOSS_MASK: loss}, batch_size=[B])


def _train(state, steps, start=0):
    losses = []
    for i in range(start, start + steps):
        state, stats = ff.sft_step(state, _batch(i), ff.SFTConfig())
        assert float(stats["grad_norm"]) > OPT.max_grad_norm  # the clip is active
        losses.append(float(stats["loss"]))
    return state, losses


def _snapshot(state) -> dict:
    out = {}
    for name, param in state.model.named_parameters():
        out[f"p/{name}"] = param.to_local().detach().float().cpu()
        for key, value in state.optimizer.state.get(param, {}).items():
            local = value.to_local() if hasattr(value, "to_local") else value
            out[f"o/{name}/{key}"] = local.detach().float().cpu()
    return out


def _ulps(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> float:
    """Largest |a - b| in units of the last place of ``dtype`` at a's magnitude."""
    a, b = a.to(torch.float64), b.to(torch.float64)
    tiny = torch.finfo(dtype).tiny
    ulp = torch.finfo(dtype).eps * torch.clamp(a.abs(), min=tiny)
    return float(((a - b).abs() / ulp).max()) if a.numel() else 0.0


def _assert_within_ulps(a: dict, b: dict, dtype: torch.dtype, ulps: float, what: str):
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())[:5]
    worst = max(((_ulps(a[k], b[k], dtype), k) for k in a), default=(0.0, ""))
    assert worst[0] <= ulps, f"{what}: {worst[1]} differs by {worst[0]:.1f} ulp"


def _synthetic_steps(state, steps):
    """Optimizer steps on gradients drawn from a seed (the same for every state, whatever the
    backward kernels' order of summation), clipped like grad_step clips."""
    from fsdpfn.engine.step import _clip_, global_grad_norm

    for i in range(steps):
        gen = torch.Generator().manual_seed(i)
        for param in state.model.parameters():
            local = torch.randn(param.to_local().shape, generator=gen) * 1e-2
            param.grad = type(param).from_local(local.to(param.to_local()), param.device_mesh,
                                                param.placements, shape=param.shape,
                                                stride=param.stride())
        norm = global_grad_norm(state.model, state.mesh)
        _clip_(state.model, torch.clamp(OPT.max_grad_norm / (norm + 1e-6), max=1.0))
        state.optimizer.step()
        state.scheduler.step()
        state.optimizer.zero_grad(set_to_none=True)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("optimizer_dtype", ["float32", "bfloat16"])
def test_per_layer_step_equals_the_default_optimizer_on_cuda(optimizer_dtype):
    dtype = getattr(torch, optimizer_dtype)
    plain = _state(optimizer_dtype)
    ours = _state(optimizer_dtype, per_layer_optim_step=True)
    _assert_within_ulps(_snapshot(plain), _snapshot(ours), dtype, 0.0, "initial weights")
    _synthetic_steps(plain, 5)
    _synthetic_steps(ours, 5)
    _assert_within_ulps(_snapshot(plain), _snapshot(ours), dtype, 1.0, optimizer_dtype)
    states = [v for s in ours.optimizer.state.values() for k, v in s.items() if k != "step"]
    assert states and all(v.to_local().device.type == "cpu" and v.to_local().is_pinned()
                          for v in states)
    # and grad_step trains with it (a fresh state: the steps above ran outside fsdpfn, which
    # the stale-state check refuses by design)
    _train(_state(optimizer_dtype, per_layer_optim_step=True), 2)


@pytest.mark.timeout(600)
def test_compiled_blocks_train_with_the_per_layer_step_on_cuda():
    plain, plain_losses = _train(_state(compile=True), 3)
    ours, losses = _train(_state(compile=True, per_layer_optim_step=True), 3)
    assert type(ours.optimizer).__name__ == "PerLayerAdamW"
    assert losses[0] == plain_losses[0]  # the same weights and batch: the same first loss
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(plain_losses), rtol=2e-3,
                               atol=0)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("prefetch", [0, 2])
def test_per_layer_step_holds_at_most_the_prefetch_window_on_the_device(prefetch):
    state, _ = _train(_state(per_layer_optim_step=True, optim_step_prefetch_layers=prefetch), 1)
    optimizer = state.optimizer
    unit_bytes = max(sum(p.to_local().numel() * 4 * 2 for _, p in unit)  # exp_avg, exp_avg_sq
                     for unit in optimizer._units)  # noqa: SLF001
    for param in state.model.parameters():
        param.grad = torch.ones_like(param)
    device = torch.cuda.current_device()
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    optimizer.step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated(device) - baseline
    assert peak <= (1 + prefetch) * unit_bytes * 1.05 + 2**20, (peak, unit_bytes)
    assert torch.cuda.memory_allocated(device) <= baseline + 2**20


def _round_trip(tmp_path, **fsdp):
    state, _ = _train(_state(**fsdp), 2)
    save_checkpoint(state, tmp_path / "ckpt")
    straight, losses = _train(state, 2, start=2)
    loaded, _ = load_checkpoint(_state(seed=7, **fsdp), tmp_path / "ckpt")
    resumed, resumed_losses = _train(loaded, 2, start=2)
    # flash attention's backward sums in no fixed order: equal up to that, where a load that
    # missed the weights (seed 7) or the Adam moments would be off by whole updates
    torch.testing.assert_close(resumed_losses, losses, rtol=1e-4, atol=0)
    a, b = _snapshot(straight), _snapshot(resumed)
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-3, atol=1e-6, msg=key)
    return straight


@pytest.mark.timeout(600)
def test_offload_params_trains_on_cuda_with_clipping_and_checkpoints(tmp_path):
    state = _round_trip(tmp_path, offload_params=True)
    assert all(p.to_local().device.type == "cpu" for p in state.model.parameters())
    default, default_losses = _train(_state(), 4)
    offloaded, losses = _train(_state(offload_params=True), 4)
    # the CPU AdamW and the fused CUDA one round differently; the runs track each other
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(default_losses), rtol=1e-3,
                               atol=1e-3)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("offload", [False, True])
def test_per_layer_checkpoints_round_trip_on_cuda(tmp_path, offload):
    _round_trip(tmp_path, per_layer_optim_step=True, offload_params=offload)


# ---------------------------------------------------------------- a GPU that another process holds

# an embedded model of about 0.1 B parameters: a few GiB of fp32 state, far below any GPU's total
BIG_EMBEDDED = ["model.hidden_size=1024", "model.intermediate_size=4096", "model.num_layers=8",
                "launch.nproc=1"]


def _dry_run(tmp_path, *extra):
    return subprocess.run([sys.executable, "-m", "fsdpfn", "run", "sft",
                           f"run_dir={tmp_path / 'run'}", *BIG_EMBEDDED, *extra, "--dry-run"],
                          capture_output=True, text=True, timeout=120)


def test_a_gpu_that_another_process_holds_is_named_before_the_run(tmp_path):
    """Another process holds all but 0.5 GiB of GPU 0: the dry run that fit the GPU before is
    refused, naming what is free and what the other process holds (nvidia-smi's figures).

    The GPU need not be idle when the test starts: in the whole suite this pytest process has
    run GPU tests of its own, and what its caching allocator kept counts as another process's
    memory to the launcher. The cache is emptied first; where something still holds 1 GiB or
    more, the first dry run names it too, and only the refusal after the holder is asserted."""
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    used = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,"
                           "nounits", "-i", "0"], capture_output=True, text=True, timeout=30)
    idle = used.returncode == 0 and float(used.stdout.split()[0]) < 1024  # MiB
    proc = _dry_run(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "memory estimate per GPU" in proc.stderr, proc.stderr
    assert (" free (" not in proc.stderr) == idle, (used.stdout, proc.stderr)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, torch\n"
         "free, total = torch.cuda.mem_get_info(0)\n"
         "x = torch.empty(free - 2 ** 29, dtype=torch.uint8, device='cuda:0')\n"
         "print('held', flush=True)\nsys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        proc = _dry_run(tmp_path)
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert proc.returncode == 2, proc.stderr
    assert "fsdpfn: error: engine: the run does not fit one GPU, memory estimate per GPU: " \
        in proc.stderr and " GiB free (" in proc.stderr, proc.stderr
    assert "in use by other processes (nvidia-smi): GPU 0: " in proc.stderr, proc.stderr
    assert proc.stderr.rstrip().endswith("(or free the GPUs that other processes hold)")
    assert not (tmp_path / "run").exists()
