"""transport="disk" of a RolloutTarget: the ranks write ``disk_root/v{version}`` (a DiskTarget
layout, which the servers must be able to read at the same path), then rank 0 asks every server
to load it with /update_weights_from_disk, generation paused around the swap, and rotates the old
versions out (``keep_last``).

fsdpfn.rollout servers answer with the version and the weights checksum, checked against what
was written. SGLang servers take their own request fields and answer success and message only:
the version is read back with /get_weight_version, and every rank then runs the log-prob probe
(fsdpfn.weights.sglang).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import torch

from fsdpfn.engine.agree import agree_on_error, capture_error, is_rank_zero
from fsdpfn.errors import WeightSyncError
from fsdpfn.engine.state import EngineState
from fsdpfn.weights.disk import rotate, write_version
from fsdpfn.weights.channel import check_commit
from fsdpfn.weights.servers import Servers
from fsdpfn.weights.sglang import check_versions, disk_request, probe
from fsdpfn.wire.http import Call, call

__all__ = ["push_disk"]


def push_disk(state: EngineState, servers: Servers, dtype: torch.dtype, *,
              sglang: bool) -> tuple[int, int]:
    """Collective: write, load (rank 0), rotate (rank 0), agree; returns (n_tensors, n_bytes)."""
    cfg = servers.config
    final, n_tensors, n_bytes, checksum = write_version(
        state, cfg.disk_root, dtype=dtype, bucket_bytes=cfg.bucket_bytes)
    error = None
    if is_rank_zero():
        merged = state.config.lora is not None
        _, error = capture_error(lambda: _load_sglang(servers, final, state.version, checksum)
                                 if sglang else _load(servers, final, state.version, checksum,
                                                      merged_adapters=merged),
                                 "loading from disk")
        if error is None:
            _, error = capture_error(lambda: rotate(cfg.disk_root, cfg.keep_last, final),
                                     "rotating old versions")
    agree_on_error(state.mesh, error)
    if sglang:
        probe(state, servers.urls, dtype, probe_tol=cfg.probe_tol, timeout_s=cfg.timeout_s)
    return n_tensors, n_bytes


def _load(servers: Servers, directory: Path, version: int, checksum: int, *,
          merged_adapters: bool = False) -> None:
    payload = {"model_path": str(directory.resolve()), "weight_version": version,
               "flush_cache": servers.config.flush_cache, "verify_checksums": True,
               "merged_adapters": merged_adapters}

    def update() -> None:
        for url, answer in _post_to_all(servers, payload).items():
            check_commit(url, answer, version, checksum)

    _while_paused(servers, update)


def _load_sglang(servers: Servers, directory: Path, version: int, checksum: int) -> None:
    """SGLang's /update_weights_from_disk (its fields; the answer carries success and message
    only), generation paused around it; then its /get_weight_version."""
    payload = disk_request(str(directory.resolve()), version=version,
                           flush_cache=servers.config.flush_cache)
    _while_paused(servers, lambda: _post_to_all(servers, payload))
    check_versions(servers.urls, version, servers.config.timeout_s)


def _post_to_all(servers: Servers, payload: dict) -> dict[str, dict]:
    """/update_weights_from_disk to every server at once; their answers, or one WeightSyncError
    naming every server that failed."""
    timeout = servers.config.timeout_s
    deadline = time.monotonic() + timeout
    calls = {url: Call(lambda url=url: call(url, "/update_weights_from_disk", payload,
                                            timeout=timeout),
                       f"server {url}: /update_weights_from_disk")
             for url in servers.urls}
    answers, errors = {}, []
    for url, c in calls.items():
        try:
            answers[url] = c.result(deadline + 1.0)
        except WeightSyncError as exc:
            errors.append(str(exc))
    if errors:
        raise WeightSyncError("; ".join(errors))
    return answers


def _while_paused(servers: Servers, update: Callable[[], object]) -> None:
    """``update()`` with generation paused; resumed on every path out (a failure to resume
    after a success raises)."""
    servers.pause()
    try:
        update()
    except BaseException:
        servers.resume(strict=False)
        raise
    servers.resume(strict=True)
