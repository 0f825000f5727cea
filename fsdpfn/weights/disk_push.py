"""transport="disk" of a RolloutTarget: the ranks write ``disk_root/v{version}`` (a DiskTarget
layout, which the servers must be able to read at the same path), then rank 0 asks every server
to load it with /update_weights_from_disk, generation paused around the swap, and rotates the old
versions out (``keep_last``).

fsdpfn.rollout servers load in two phases, so that a push one of them refuses leaves every
server on the weights it served: each loads and checks the files and keeps them staged
(``commit: false``), answering the checksum they will have, checked against what was written;
only when every server staged them does each swap them in (/update_weights_commit), generation
paused around the swaps alone. A failure before that drops what the others staged. SGLang
servers take their own request fields and answer success and message only:
the version is read back with /get_weight_version, and every rank then runs the log-prob probe
(fsdpfn.weights.sglang).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Callable

import torch

from fsdpfn.agree import agree_on_error, capture_error, is_rank_zero
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
        elif not sglang:  # refused everywhere, served nowhere: a full copy nobody needs
            shutil.rmtree(final, ignore_errors=True)
    agree_on_error(state.mesh, error)
    if sglang:
        probe(state, servers.urls, dtype, probe_tol=cfg.probe_tol, timeout_s=cfg.timeout_s)
    return n_tensors, n_bytes


def _load(servers: Servers, directory: Path, version: int, checksum: int, *,
          merged_adapters: bool = False) -> None:
    payload = {"model_path": str(directory.resolve()), "weight_version": version,
               "flush_cache": servers.config.flush_cache, "verify_checksums": True,
               "merged_adapters": merged_adapters, "commit": False,
               "timeout_s": servers.config.timeout_s}
    answers, errors = _post_each(servers, "/update_weights_from_disk", payload)
    for url, answer in answers.items():
        try:
            check_commit(url, answer, version, checksum)
        except WeightSyncError as exc:
            errors.append(str(exc))
    if errors:  # nothing swapped anywhere: what was staged is dropped
        _post_each(servers, "/update_weights_commit",
                   {"weight_version": version, "commit": False,
                    "timeout_s": servers.config.timeout_s}, urls=list(answers))
        raise WeightSyncError("; ".join(errors) + "; every server keeps the weights it served")

    def commit() -> None:
        # each server swaps within the call's timeout or answers a failure, its weights kept
        done, failed = _post_each(servers, "/update_weights_commit",
                                  {"weight_version": version, "commit": True,
                                   "timeout_s": servers.config.timeout_s})
        for url, answer in done.items():
            check_commit(url, answer, version, checksum)
        if failed:
            raise WeightSyncError("; ".join(failed) + f" (the others serve version {version})")

    _while_paused(servers, commit)


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
    answers, errors = _post_each(servers, "/update_weights_from_disk", payload)
    if errors:
        raise WeightSyncError("; ".join(errors))
    return answers


def _post_each(servers: Servers, path: str, payload: dict, urls: list[str] | None = None
               ) -> tuple[dict[str, dict], list[str]]:
    """``path`` to every server (of ``urls``) at once: (the answers, the failures' messages)."""
    timeout = servers.config.timeout_s
    deadline = time.monotonic() + timeout
    calls = {url: Call(lambda url=url: call(url, path, payload, timeout=timeout),
                       f"server {url}: {path}")
             for url in (servers.urls if urls is None else urls)}
    answers, errors = {}, []
    for url, c in calls.items():
        try:
            answers[url] = c.result(deadline + 1.0)
        except WeightSyncError as exc:
            errors.append(str(exc))
    return answers, errors


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
