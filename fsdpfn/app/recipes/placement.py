"""Where ``fsdpfn run`` puts its processes: trainer ranks and the rollout server, on the CPU or
on disjoint GPUs, and how weights travel between them.

    place(cfg, n_gpus)  ->  Placement(device, nproc, trainer_gpus, server_device, server_gpus,
                                      transport, dtype, servers)

Defaults on a host with N GPUs (``device: auto`` finds N > 0): an RL recipe with its own server
serves on the last GPU and trains on the others (N >= 2), or shares GPU 0 (N == 1); the
supervised recipes train on every GPU. One trainer rank per GPU. Several servers
(``rollout.gpus: [4, 5, 6, 7]``, or ``rollout.servers: K``: the last K GPUs, or K CPU processes)
run one per GPU, each on a GPU of its own: a trainer GPU that also serves is refused, and the
trainer defaults to the GPUs no server uses. Weights travel by NCCL broadcast
when trainer and server hold different GPUs. On a shared GPU NCCL cannot connect the two
processes: weights go by CUDA IPC (trainer rank 0 hands the server handles to device buffers of
the gathered weights, no copy through the host: BENCHMARKS.md, "Weight push on one GPU") when
the server shares rank 0's GPU, else by disk (safetensors written by the trainer, read by the
server). Indices are those
of the launcher's view (its CUDA_VISIBLE_DEVICES, when set); each process is started with
CUDA_VISIBLE_DEVICES naming its own GPUs.
"""

from __future__ import annotations

import glob
import os
import sys

import attrs

from fsdpfn.errors import ConfigError

__all__ = ["Placement", "place", "visible_gpus", "count_gpus", "resolve_dtype",
           "check_parallel"]


@attrs.frozen
class Placement:
    device: str                       # the trainer's: "cpu" or "cuda"
    nproc: int                        # trainer ranks
    trainer_gpus: tuple[int, ...]     # launcher indices, one per rank (empty on CPU)
    server_device: str | None         # None: no server of ours
    server_gpus: tuple[int, ...]
    transport: str                    # "broadcast", "ipc" or "disk"
    dtype: str                        # the trainer's compute dtype
    servers: int = 1                  # servers of ours (one per server GPU on CUDA); 0: none

    def server_env(self, i: int) -> dict:
        """CUDA_VISIBLE_DEVICES of server ``i`` (its own GPU; nothing on the CPU)."""
        return self.env(self.server_gpus[i:i + 1]) if self.server_gpus else {}

    def env(self, gpus: tuple[int, ...]) -> dict:
        """CUDA_VISIBLE_DEVICES for a process that uses ``gpus`` (launcher indices)."""
        if not gpus:
            return {}
        return {"CUDA_VISIBLE_DEVICES": ",".join(visible_gpus()[i] for i in gpus)}


def server_log_name(i: int) -> str:
    """The log, in run_dir, of server ``i`` fsdpfn run starts: rollout.log, rollout1.log, ..."""
    return "rollout.log" if i == 0 else f"rollout{i}.log"


def visible_gpus() -> list[str]:
    """The launcher's GPUs as CUDA_VISIBLE_DEVICES entries (index i of the list is GPU i)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [v.strip() for v in env.split(",") if v.strip()]
    return [str(i) for i in range(count_gpus())]


def count_gpus() -> int:
    """CUDA devices this process can see (0 without CUDA); cached after the first call. A Linux
    host without NVIDIA's device files (nor WSL's /dev/dxg) has none, which is known without
    importing torch (2 s of every CPU launch)."""
    global _COUNT
    if _COUNT is None:
        if sys.platform.startswith("linux") and not _cuda_device_files():
            _COUNT = 0
        else:
            import torch

            _COUNT = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return _COUNT


def _cuda_device_files() -> bool:
    return bool(glob.glob("/dev/nvidia[0-9]*")) or os.path.exists("/dev/dxg")


_COUNT: int | None = None


def _check_indices(key: str, gpus, n_gpus: int) -> None:
    bad = [g for g in gpus if g >= n_gpus]
    if bad:
        raise ConfigError(f"{key}: GPU indices must be < {n_gpus} (this host's GPUs), got "
                          f"{list(gpus)}")


def place(cfg, n_gpus: int, *, needs_rollout: bool) -> Placement:
    """The placement of ``cfg`` (a recipe config) on a host with ``n_gpus`` GPUs."""
    launch = cfg.launch
    own_server = needs_rollout and cfg.rollout.url is None
    device = launch.device if launch.device != "auto" else ("cuda" if n_gpus else "cpu")
    if device == "cuda" and n_gpus == 0:
        raise ConfigError("launch.device: 'cuda' needs a GPU and this host has none, got "
                          "'cuda' (use auto or cpu)")
    rollout_dev = None
    if own_server:
        rollout_dev = cfg.rollout.device if cfg.rollout.device != "auto" else device
        if rollout_dev == "cuda" and n_gpus == 0:
            raise ConfigError("rollout.device: 'cuda' needs a GPU and this host has none, got "
                              "'cuda'")
    n_servers = cfg.rollout.n_servers if own_server else 0
    server_gpus: tuple[int, ...] = ()
    if rollout_dev == "cuda":
        server_gpus = cfg.rollout.gpus or _last_gpus(n_servers, n_gpus)
        _check_indices("rollout.gpus", server_gpus, n_gpus)
    trainer_gpus: tuple[int, ...] = ()
    if device == "cuda":
        if launch.gpus is not None:
            trainer_gpus = launch.gpus
        else:
            rest = tuple(g for g in range(n_gpus) if g not in server_gpus)
            if not rest and n_servers > 1:
                raise ConfigError(f"rollout.gpus: {n_servers} servers on GPUs of their own "
                                  f"leave none of this host's {n_gpus} GPUs to the trainer, "
                                  f"got {list(server_gpus)}")
            trainer_gpus = rest or (0,)
        _check_indices("launch.gpus", trainer_gpus, n_gpus)
        _check_disjoint(trainer_gpus, server_gpus, n_servers)
        nproc = launch.nproc or len(trainer_gpus)
        if nproc > len(trainer_gpus):
            raise ConfigError(f"launch.nproc: one trainer rank per GPU, and launch.gpus gives "
                              f"{len(trainer_gpus)} ({list(trainer_gpus)}), got {nproc}")
        trainer_gpus = trainer_gpus[:nproc]
    else:
        if launch.gpus is not None:
            why = "this host has none" if n_gpus == 0 else "launch.device is 'cpu'"
            raise ConfigError(f"launch.gpus: places trainer ranks on CUDA GPUs, and this run's "
                              f"trainer is on the CPU ({why}), got {list(launch.gpus)}")
        nproc = launch.nproc or 2
    _check_layout(cfg, nproc)
    shared = bool(set(trainer_gpus) & set(server_gpus))
    rank0_shares = bool(trainer_gpus) and trainer_gpus[0] in server_gpus
    transport = cfg.rollout.transport if needs_rollout else "broadcast"
    if transport == "auto":
        transport = ("ipc" if rank0_shares else "disk") if shared else "broadcast"
    elif transport == "ipc" and n_servers > 1:
        raise ConfigError(f"rollout.transport: 'ipc' hands CUDA memory of trainer rank 0's GPU "
                          f"to a server on that GPU, and {n_servers} servers each hold a GPU of "
                          f"their own ({list(server_gpus) or 'CPU'}); use auto, broadcast or "
                          f"disk, got 'ipc'")
    elif transport == "ipc" and not rank0_shares:
        raise ConfigError(f"rollout.transport: 'ipc' needs the server on trainer rank 0's GPU "
                          f"(trainer GPUs {list(trainer_gpus)}, server GPU {list(server_gpus)}), "
                          f"got 'ipc'")
    elif transport == "broadcast" and shared:
        raise ConfigError(f"rollout.transport: 'broadcast' needs the server on a GPU of its own "
                          f"(NCCL cannot connect two processes on one device); trainer GPUs "
                          f"{list(trainer_gpus)}, server GPU {list(server_gpus)}; use auto or "
                          f"disk, got 'broadcast'")
    dtype = resolve_dtype(cfg, device)
    return Placement(device=device, nproc=nproc, trainer_gpus=tuple(trainer_gpus),
                     server_device=rollout_dev, server_gpus=tuple(server_gpus),
                     transport=transport, dtype=dtype, servers=n_servers)


def _last_gpus(n_servers: int, n_gpus: int) -> tuple[int, ...]:
    """The default server GPUs: the host's last one, or its last ``n_servers`` with a GPU left
    for the trainer."""
    if n_servers <= 1:
        return (n_gpus - 1,)
    if n_servers >= n_gpus:
        raise ConfigError(f"rollout.servers: {n_servers} servers on GPUs of their own and a "
                          f"trainer GPU need {n_servers + 1} GPUs, this host has {n_gpus}; got "
                          f"{n_servers}")
    return tuple(range(n_gpus - n_servers, n_gpus))


def _check_disjoint(trainer_gpus, server_gpus, n_servers: int) -> None:
    """Several servers: no trainer GPU serves (one server may share a GPU: ipc or disk)."""
    both = sorted(set(trainer_gpus) & set(server_gpus))
    if n_servers > 1 and both:
        raise ConfigError(f"launch.gpus: with {n_servers} rollout servers no trainer GPU may "
                          f"also serve (rollout.gpus {list(server_gpus)}); GPU {both[0]} is in "
                          f"both, got {list(trainer_gpus)}")


def _check_layout(cfg, nproc: int) -> None:
    """dp x cp x tp must fill the ranks the launch starts (before any rank starts)."""
    p = cfg.parallel
    inner = p.tp * p.cp
    if p.dp == -1:
        if nproc % inner:
            key = "cp" if p.tp == 1 else "tp"  # the one the user set (both: tp)
            raise ConfigError(f"parallel.{key}: tp x cp = {p.tp} x {p.cp} = {inner} must divide "
                              f"the {nproc} trainer ranks (launch.nproc), got {key}="
                              f"{getattr(p, key)}")
    elif p.dp * inner != nproc:
        raise ConfigError(f"parallel.dp: dp x cp x tp = {p.dp} x {p.cp} x {p.tp} = "
                          f"{p.dp * inner} must equal the {nproc} trainer ranks (launch.nproc), "
                          f"got dp={p.dp}")


def resolve_dtype(cfg, device: str) -> str:
    """A recipe's ``engine.dtype: auto``: float32 on the CPU, bfloat16 on CUDA."""
    if cfg.engine.dtype != "auto":
        return cfg.engine.dtype
    return "bfloat16" if device == "cuda" else "float32"


# the rows of one step each recipe hands its data-parallel ranks (whole groups or pairs a rank)
STEP_ROWS = {"grpo": "prompts_per_step", "ppo": "prompts_per_step", "sft": "batch_size",
             "rw": "pairs_per_step", "dpo": "pairs_per_step"}


def check_parallel(cfg, placement, hf: dict) -> None:
    """What the trainer ranks would refuse once started, refused before: tp dividing the
    attention heads (and the heads a whole number of kv heads each), a step's rows, groups or
    pairs at least one per data-parallel rank, and the engine options that need CUDA."""
    p = cfg.parallel
    dp = p.dp if p.dp != -1 else max(placement.nproc // (p.tp * p.cp), 1)
    heads, kv = hf.get("num_attention_heads"), hf.get("num_key_value_heads")
    where = "model.num_heads" if cfg.model.embedded else f"model.path ({cfg.model.path})"
    if isinstance(heads, int) and isinstance(kv, int) and kv and heads % kv:
        raise ConfigError(f"{'model.num_kv_heads' if cfg.model.embedded else where}: the "
                          f"attention heads must be a whole number of kv heads each, got "
                          f"{heads} heads on {kv} kv heads")
    if isinstance(heads, int) and heads % p.tp:
        raise ConfigError(f"parallel.tp: must divide the model's num_attention_heads ({heads}, "
                          f"{where}), got tp={p.tp}")
    key = STEP_ROWS.get(cfg.recipe)
    if key is not None and getattr(cfg, key) < dp:
        raise ConfigError(f"{key}: must be >= the {dp} data-parallel ranks (each rank trains "
                          f"whole {'groups' if key == 'prompts_per_step' else 'rows'} of a "
                          f"step), got {getattr(cfg, key)}")
    warmup = getattr(cfg, "warmup", None)
    if warmup is not None and warmup.steps != 0 and warmup.batch_size < dp:
        raise ConfigError(f"warmup.batch_size: must be >= the {dp} data-parallel ranks, got "
                          f"{warmup.batch_size}")
    if placement.device != "cuda":
        for name, value in (("attn_impl", "varlen"), ("logprobs_impl", "liger")):
            if getattr(cfg.engine, name) == value:
                raise ConfigError(f"engine.{name}: {value!r} needs CUDA and this run's trainer "
                                  f"is on {placement.device} (launch.device), got {value!r}")
