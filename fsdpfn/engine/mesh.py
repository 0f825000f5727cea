"""build_mesh: the world-size arithmetic, the process group, and the named axes dp, cp, tp."""

from __future__ import annotations

import datetime
import os

import attrs
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdpfn.config import ParallelStrategy
from fsdpfn.errors import ConfigError
from fsdpfn.wire.ports import free_port

__all__ = ["Mesh", "build_mesh", "resolve_strategy", "check_mesh"]

AXES = ("dp", "cp", "tp")


@attrs.frozen(eq=False)
class Mesh:
    """A DeviceMesh over (dp, cp, tp) plus the flattened dp×cp mesh that FSDP2 shards over."""

    device_mesh: DeviceMesh
    strategy: ParallelStrategy  # resolved: dp is never -1 here
    device_type: str
    fsdp_mesh: DeviceMesh = attrs.field(repr=False)

    @property
    def dp(self) -> int:
        return self.strategy.dp

    @property
    def tp(self) -> int:
        return self.strategy.tp

    @property
    def cp(self) -> int:
        return self.strategy.cp

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp

    def rank(self, axis: str) -> int:
        """This rank's coordinate along ``axis`` (dp, cp or tp)."""
        return self.device_mesh.get_local_rank(axis)

    def group(self, axis: str) -> dist.ProcessGroup:
        """The process group of ``axis``: 'dp', 'cp', 'tp', or 'dp_cp' (what FSDP shards over)."""
        if axis == "dp_cp":
            return self.fsdp_mesh.get_group()
        return self.device_mesh.get_group(axis)

    @property
    def device(self) -> torch.device:
        if self.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(self.device_type)


def check_mesh(mesh, *, optional: bool = False) -> None:
    """ConfigError unless ``mesh`` is a fsdpfn Mesh (build_mesh's); ``optional``: None passes."""
    if isinstance(mesh, Mesh) or (optional and mesh is None):
        return
    raise ConfigError(f"mesh: must be an fsdpfn Mesh (build_mesh){' or None' if optional else ''}"
                      f", got {type(mesh).__name__}")


def resolve_strategy(strategy: ParallelStrategy, world_size: int) -> ParallelStrategy:
    """Fill in dp=-1 and check dp·cp·tp == world_size; the error prints the arithmetic."""
    if not isinstance(strategy, ParallelStrategy):
        raise ConfigError(f"strategy: must be a ParallelStrategy, got {strategy!r}")
    cp, tp = strategy.cp, strategy.tp
    if strategy.dp == -1:
        if world_size % (cp * tp):
            raise ConfigError(
                f"ParallelStrategy: dp=-1 takes world_size / (cp x tp) = {world_size} / "
                f"({cp} x {tp}), which is not a whole number; choose cp and tp whose product "
                f"divides {world_size}")
        return attrs.evolve(strategy, dp=world_size // (cp * tp))
    if strategy.dp * cp * tp != world_size:
        raise ConfigError(
            f"ParallelStrategy: dp x cp x tp = {strategy.dp} x {cp} x {tp} = "
            f"{strategy.dp * cp * tp}, but the world size is {world_size}; set dp=-1 to use "
            f"whatever is left")
    return strategy


def _init_process_group(device_type: str) -> None:
    backend = "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=float(os.environ.get("FSDPFN_PG_TIMEOUT", 1800)))
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # started by torchrun
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=timeout)
    else:  # a plain `python script.py`: a one-rank group
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}",
                                rank=0, world_size=1, timeout=timeout)


def build_mesh(strategy: ParallelStrategy, *, device_type: str | None = None) -> Mesh:
    """Build the (dp, cp, tp) mesh, initialising the default process group when needed.

    ``device_type`` defaults to "cuda" when CUDA is available, else "cpu".
    """
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type not in ("cpu", "cuda"):
        raise ConfigError(f"device_type: must be 'cpu' or 'cuda', got {device_type!r}")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device_type: 'cuda' needs a CUDA device, got none available")
    world_size = dist.get_world_size() if dist.is_initialized() else int(
        os.environ.get("WORLD_SIZE", 1))
    resolved = resolve_strategy(strategy, world_size)  # validate before any collective
    if not dist.is_initialized():
        _init_process_group(device_type)
    elif device_type == "cuda" and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    shape = (resolved.dp, resolved.cp, resolved.tp)
    device_mesh = init_device_mesh(device_type, shape, mesh_dim_names=AXES)
    fsdp_mesh = device_mesh["dp", "cp"]._flatten("dp_cp")
    return Mesh(device_mesh=device_mesh, strategy=resolved, device_type=device_type,
                fsdp_mesh=fsdp_mesh)
