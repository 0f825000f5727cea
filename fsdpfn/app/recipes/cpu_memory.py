"""A CPU run against the host's memory: every trainer rank's share of the state, the layers it
gathers and its activations, the rollout servers' weights and each process's own footprint, all
in the one host's memory. A run that does not fit is refused before launch, naming the options
that would make it fit (a CPU run that runs out of memory is killed by the kernel part way in,
with nothing but "killed by SIGKILL" to say why).

    check_cpu_memory(cfg, shape, placement, available=...)

The per-rank terms are fsdpfn.app.recipes.memory's estimate (the same written-out formula as on
a GPU) at the trainer's compute dtype (float32 on the CPU unless engine.dtype says otherwise).
A server's generation cache grows with the answers it is asked for and is left out, so the
estimate errs on the side of running.
"""

from __future__ import annotations

import attrs

from fsdpfn.errors import ConfigError
from fsdpfn.app.recipes.memory import (BYTES, FIXES, HEADROOM, GiB, ModelShape, _applied,
                                       run_estimate)

__all__ = ["cpu_estimate", "check_cpu_memory", "RANK_PROCESS_BYTES", "SERVER_PROCESS_BYTES"]

# a CPU trainer rank's Python with torch, transformers and fsdpfn imported, before any tensor
# and a rollout server's (0.48 and 0.47 GiB measured in a CPU demo run)
RANK_PROCESS_BYTES = 0.5 * GiB
SERVER_PROCESS_BYTES = 0.5 * GiB

# the fixes that shrink a CPU run: those of a GPU run that do not only move state to the host
CPU_FIXES = ("engine.optimizer_dtype=bfloat16", "engine.gradient_checkpointing=true",
             "engine.lora.rank=16")


def _at_dtype(cfg, dtype: str):
    """``cfg`` with the policy's ``auto`` dtype as the run resolves it (the reference and the
    critic inherit it unless their sections set their own)."""
    if cfg.engine.dtype != "auto":
        return cfg
    return attrs.evolve(cfg, engine=attrs.evolve(cfg.engine, dtype=dtype))


def cpu_estimate(cfg, shape: ModelShape, *, nproc: int, dtype: str,
                 servers: int) -> dict[str, float]:
    """Bytes of the whole CPU run on its host: ``nproc`` ranks' share of run_estimate (the
    states summed are the whole state once; the gathered layers and activations are each
    rank's), one full copy of the weights in ``dtype`` (what an export, a checkpoint or a push
    gathers), ``servers`` rollout servers' weights in ``dtype``, and every process's own."""
    per_rank = run_estimate(_at_dtype(cfg, dtype), shape, n_gpus=nproc, shared=False)
    out = {k: v * nproc for k, v in per_rank.items() if k != "total"}
    # export_hf, a checkpoint's staging and a push's gather hold the whole model once more
    out["a full copy (saves, pushes)"] = BYTES.get(dtype, 4) * shape.params
    if servers:
        out["rollout servers"] = servers * BYTES.get(dtype, 4) * shape.params
    out["processes"] = nproc * RANK_PROCESS_BYTES + servers * SERVER_PROCESS_BYTES
    out["total"] = sum(out.values())
    return out


def check_cpu_memory(cfg, shape: ModelShape, placement, *, available: float | None) -> str | None:
    """The estimate against the host's available memory: a note when it fits (None when the
    host's memory is unknown), else a ConfigError naming what would make it fit."""
    if available is None:
        return None
    servers = placement.servers if placement.server_device == "cpu" else 0

    def total(c, nproc=placement.nproc):
        return cpu_estimate(c, shape, nproc=nproc, dtype=placement.dtype,
                            servers=servers)["total"]

    est = cpu_estimate(cfg, shape, nproc=placement.nproc, dtype=placement.dtype, servers=servers)
    parts = ", ".join(f"{k} {v / GiB:.1f}" for k, v in est.items()
                      if k != "total" and v >= 0.05 * GiB)
    line = (f"host memory estimate of this CPU run ({placement.nproc} trainer rank(s)): "
            f"{est['total'] / GiB:.1f} GiB of {available / GiB:.1f} GiB available ({parts})")
    if est["total"] <= HEADROOM * available:
        return line
    fixes = [name for name in CPU_FIXES
             if (fixed := _applied(FIXES[name], cfg)) is not None
             and total(fixed) <= HEADROOM * available]
    if placement.nproc > 1 and total(cfg, 1) <= HEADROOM * available:
        fixes.append("launch.nproc=1")
    hint = ("; it would fit with " + " or ".join(fixes)) if fixes else \
        "; no option makes it fit: use a smaller model, or a GPU host"
    raise ConfigError(f"engine: the run does not fit this host's memory, {line}, more than "
                      f"{HEADROOM:.0%} of it{hint}")
