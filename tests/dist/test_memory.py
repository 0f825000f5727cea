"""Memory options on 2 CPU ranks (gloo): the per-layer optimizer step (fsdp.per_layer_optim_step)
equals plain AdamW (Kahan AdamW for bf16 master weights) bit for bit through grad_step's
clipping, non-finite vote and LR schedule; offload_params trains like the default; checkpoints
round-trip with every option."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from tensordict import TensorDict

import fsdpfn as ff
from fsdpfn import keys as K
from fsdpfn.checkpoint import load_checkpoint, save_checkpoint
from fsdpfn.testing import tiny_qwen2_config

pytestmark = pytest.mark.dist

# max_grad_norm well below the gradients' norm: every step is clipped
OPT = ff.OptimizerConfig(lr=1e-2, schedule="cosine", warmup_steps=2, total_steps=6,
                         weight_decay=0.1, max_grad_norm=0.05)
OPTIONS = {  # name -> (optimizer_dtype, FSDPConfig)
    "per_layer": ("float32", ff.FSDPConfig(per_layer_optim_step=True)),
    "per_layer_prefetch0": ("float32", ff.FSDPConfig(per_layer_optim_step=True,
                                                     optim_step_prefetch_layers=0)),
    "per_layer_offload": ("float32", ff.FSDPConfig(per_layer_optim_step=True,
                                                   offload_params=True,
                                                   optim_step_prefetch_layers=3)),
    "offload": ("float32", ff.FSDPConfig(offload_params=True)),
    "bf16": ("bfloat16", ff.FSDPConfig()),
    "bf16_per_layer": ("bfloat16", ff.FSDPConfig(per_layer_optim_step=True)),
}


def _state(optimizer_dtype="float32", fsdp=None, seed=1):
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=-1), device_type="cpu")
    cfg = ff.EngineConfig(model_config=tiny_qwen2_config().to_dict(), dtype="float32",
                          optimizer_dtype=optimizer_dtype, optimizer=OPT,
                          fsdp=fsdp or ff.FSDPConfig(), seed=seed)
    return ff.shard_model(cfg, mesh)


def _batch(seed, B=4, T=12, V=128):
    g = torch.Generator().manual_seed(seed * 2 + dist.get_rank())
    lens = torch.randint(4, T + 1, (B,), generator=g)
    attn = torch.arange(T)[None] < lens[:, None]
    loss = attn.clone()
    loss[:, :2] = False
    return TensorDict({K.INPUT_IDS: torch.randint(0, V, (B, T), generator=g),
                       K.ATTENTION_MASK: attn, K.LOSS_MASK: loss}, batch_size=[B])


def _poisoned(outputs, mb, ctx):
    loss = -(outputs[K.LOGP] * mb[K.LOSS_MASK]).sum()
    if dist.get_rank() == 1:  # a NaN on one rank: every rank skips the step
        loss = loss * float("nan")
    return loss, {}


def _train(state, steps, start=0):
    """SFT steps; the third one (if reached) is a non-finite step that must be skipped."""
    skipped = []
    for i in range(start, start + steps):
        if i == 2:
            state, stats = ff.grad_step(state, _batch(i), _poisoned)
        else:
            state, stats = ff.sft_step(state, _batch(i), ff.SFTConfig())
        skipped.append(float(stats["skipped"]))
    return state, skipped


def _snapshot(state) -> dict:
    """This rank's shards of the parameters and of each parameter's optimizer state, by name."""
    out = {}
    for name, param in state.model.named_parameters():
        out[f"p/{name}"] = param.to_local().detach().clone()
        for key, value in state.optimizer.state.get(param, {}).items():
            local = value.to_local() if hasattr(value, "to_local") else value
            out[f"o/{name}/{key}"] = local.detach().clone()
    out["lr"] = torch.tensor([g["lr"] for g in state.optimizer.param_groups], dtype=torch.float64)
    out["meta"] = torch.tensor([state.step, state.scheduler.last_epoch])
    return out


def _differences(a: dict, b: dict) -> list[str]:
    if a.keys() != b.keys():
        return sorted(a.keys() ^ b.keys())[:5]
    return [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])][:5]


def _moved(a: dict, b: dict) -> bool:
    return any(not torch.equal(a[k], b[k]) for k in a if k.startswith("p/"))


# ---------------------------------------------------------------- per-layer step equals AdamW


def per_layer_equals_plain(names):
    out = {}
    for name in names:
        optimizer_dtype, fsdp = OPTIONS[name]
        plain = _state(optimizer_dtype)
        ours = _state(optimizer_dtype, fsdp)
        start = _snapshot(plain)
        plain, skipped_plain = _train(plain, 5)
        ours, skipped_ours = _train(ours, 5)
        a, b = _snapshot(plain), _snapshot(ours)
        out[name] = dict(kind=type(ours.optimizer).__name__, diff=_differences(a, b),
                         moved=_moved(start, a), skipped=(skipped_plain, skipped_ours),
                         steps=ours.step,
                         host=_in_reserved_host_memory(ours.optimizer))
    return out


@pytest.mark.timeout(600)
def _in_reserved_host_memory(optimizer) -> bool:
    """The per-layer step's moments live in the host blocks it reserved at build time (on CPU
    ranks every tensor is on the host, so the device alone would prove nothing): each state
    tensor is the reserved one. Other optimizers: their state on the host where the weights
    are."""
    reserved = getattr(optimizer, "_reserved", None)
    if reserved is None:
        return all(v.device.type == "cpu" for s in optimizer.state.values() for v in s.values())
    for param, state in optimizer.state.items():
        mine = reserved[id(param)]
        for name, value in state.items():
            local = value.to_local() if hasattr(value, "to_local") else value  # a DTensor
            if name != "step" and local.data_ptr() != mine[name].data_ptr():
                return False
    return bool(optimizer.state)


@pytest.mark.timeout(600)  # the sum of its ranks' bounds, and start-up
def test_per_layer_step_and_offload_equal_the_default_exactly(spmd2):
    names = list(OPTIONS)
    for rank, out in enumerate(spmd2.run(per_layer_equals_plain, args=(names,), timeout=540)):
        for name, res in out.items():
            per_layer = OPTIONS[name][1].per_layer_optim_step
            assert res["kind"] == ("PerLayerAdamW" if per_layer else
                                   "KahanAdamW" if name == "bf16" else "AdamW"), (name, res)
            assert res["moved"], f"rank {rank} {name}: the weights did not move"
            assert res["diff"] == [], f"rank {rank} {name}: differ from the default: {res['diff']}"
            assert res["skipped"] == ([0.0, 0.0, 1.0, 0.0, 0.0],) * 2, (name, res["skipped"])
            assert res["steps"] == 4 and res["host"], (name, res)


# ---------------------------------------------------------------- checkpoints round-trip


def round_trip(root, names):
    out = {}
    for name in names:
        optimizer_dtype, fsdp = OPTIONS[name]
        state, _ = _train(_state(optimizer_dtype, fsdp), 2)
        path = Path(root) / name
        save_checkpoint(state, path)
        straight, _ = _train(state, 2, start=3)
        fresh = _state(optimizer_dtype, fsdp, seed=7)  # other weights: the load replaces them
        loaded, _ = load_checkpoint(fresh, path)
        resumed, _ = _train(loaded, 2, start=3)
        out[name] = _differences(_snapshot(straight), _snapshot(resumed))
    return out


@pytest.mark.timeout(600)
def test_checkpoints_round_trip_with_each_option(spmd2, tmp_path):
    names = ["per_layer", "per_layer_offload", "offload", "bf16", "bf16_per_layer"]
    for rank, out in enumerate(spmd2.run(round_trip, args=(str(tmp_path), names), timeout=540)):
        for name, diff in out.items():
            assert diff == [], f"rank {rank} {name}: resumed run differs: {diff}"


def host_state_stays_where_it_is():
    """PerLayerAdamW's state is wrapped as DTensors around the host buffers themselves (never
    moved to the mesh's device type, never copied): on a CUDA mesh the moments must stay in
    pinned host memory."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from fsdpfn.engine.optim_offload import _like_param

    mesh = init_device_mesh("cpu", (2,))
    param = DTensor.from_local(torch.zeros(2, 3), mesh, [Shard(0)], run_check=False)
    local = torch.ones(2, 3)
    out = _like_param(local, param)
    return (out._local_tensor is local, tuple(out.shape), out.placements == param.placements)  # noqa: SLF001


@pytest.mark.timeout(120)
def test_per_layer_state_wraps_the_host_buffers_themselves(spmd2):
    for out in spmd2.run(host_state_stays_where_it_is, timeout=100):
        assert out == (True, (4, 3), True)
