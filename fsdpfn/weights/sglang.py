"""The push to a stock SGLang server, in SGLang's own protocol (its io_struct request fields, its
group set-up, its flattened-bucket layout).

How a server is told apart: fsdpfn.rollout's /get_model_info lists ``params`` (and usually an
``update_channel``); SGLang's answers model_path, tokenizer_path, is_generation,
preferred_sampling_params, weight_version, and neither of those.

Per push, on trainer rank 0 (the other ranks only gather):

  1. /pause_generation {mode} before the first bucket; /continue_generation on every path out
     (after the last bucket, or after a failure).
  2. one bucket in flight at a time (SGLang applies each request as it arrives and does not order
     concurrent ones): POST /update_weights_from_distributed {names, dtypes, shapes, group_name,
     flush_cache, abort_all_requests, weight_version (a string, on the last bucket only),
     load_format="flattened_bucket"} in a thread, and ONE broadcast of the bucket's tensors
     packed back to back (``torch.cat`` of the flattened tensors, no padding: SGLang's
     FlattenedTensorBucket), typed as the push dtype. The next bucket is gathered meanwhile.
     An answer need carry nothing but ``success`` and ``message``.
  3. verification with SGLang's own means: /get_weight_version must read the pushed version,
     and a log-prob probe (``probe``: /generate with return_logprob on a fixed prompt, greedy)
     must match ``forward_logp`` of the trainer on the same tokens (``probe_tol``; every rank
     runs the forward). SGLang has no staging: a failed check means the server holds
     something else, and the WeightSyncError says so.

The group is formed as SGLang's ``init_custom_process_group`` forms it (fsdpfn.wire.protocol
.make_group, the same for every server); a server with ``tp_size`` ranks (its /get_server_info)
joins as ``tp_size`` members. fsdpfn.rollout servers without an update channel are pushed to in
this protocol too (their /update_weights_from_distributed is SGLang's).
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch

from fsdpfn.errors import WeightSyncError
from fsdpfn.weights.gather import Bucket
from fsdpfn.wire.http import Call, call
from fsdpfn.wire.protocol import broadcast, dtype_name, wait_work

__all__ = ["is_sglang", "server_ranks", "SGLangSender", "pack",
           "probe_request", "probe_tokens", "compare_probe", "update_request", "disk_request",
           "check_versions", "run_probes", "probe"]

PROBE_NEW_TOKENS = 4


def is_sglang(info: dict) -> bool:
    """Whether a /get_model_info answer is SGLang's (no ``params``, no ``update_channel``)."""
    return "params" not in info and "update_channel" not in info


def server_ranks(url: str, timeout: float) -> int:
    """How many members a server adds to the update group: its tensor-parallel size (SGLang's
    /get_server_info ``tp_size``; 1 when it does not say)."""
    try:
        info = call(url, "/get_server_info", timeout=timeout)
    except WeightSyncError:
        return 1
    size = info.get("tp_size", 1) if isinstance(info, dict) else 1
    return int(size) if isinstance(size, int) and size >= 1 else 1


def pack(flat: torch.Tensor, bucket: Bucket) -> torch.Tensor:
    """The tensors of a gathered bucket (ALIGN-padded uint8 ``flat``) packed back to back, as
    one tensor of the push dtype: what SGLang's FlattenedTensorBucket allocates and receives."""
    parts = [flat[o:o + n] for o, n in zip(bucket.offsets, bucket.sizes)]
    packed = torch.cat(parts) if len(parts) > 1 else parts[0].clone()
    return packed.view(bucket.specs[0].dtype)


def update_request(bucket: Bucket, *, group_name: str, version: int | None,
                   flush_cache: bool, merged_adapters: bool = False) -> dict:
    """An UpdateWeightsFromDistributedReqInput body: SGLang's fields and types, and fsdpfn's
    ``merged_adapters`` (a LoRA trainer's weights with its adapters merged in: fsdpfn's server
    then refuses an adapter on top; SGLang ignores keys it does not know)."""
    body = {"names": bucket.names, "dtypes": [dtype_name(s.dtype) for s in bucket.specs],
            "shapes": [list(s.shape) for s in bucket.specs], "group_name": group_name,
            "flush_cache": bool(flush_cache), "abort_all_requests": False,
            "load_format": "flattened_bucket"}
    if merged_adapters:
        body["merged_adapters"] = True
    if version is not None:
        body["weight_version"] = str(version)
    return body


def disk_request(model_path: str, *, version: int, flush_cache: bool) -> dict:
    """An UpdateWeightFromDiskReqInput body."""
    return {"model_path": model_path, "weight_version": str(version),
            "flush_cache": bool(flush_cache), "abort_all_requests": False}


class SGLangSender:
    """Rank 0's side of a push in SGLang's protocol (a fsdpfn.weights.gather.Sender): one bucket
    in flight at a time (the driver gathers the next one meanwhile), generation paused from the
    first bucket to the end. ``servers``: a fsdpfn.weights.servers.Servers (its config, group,
    pause and resume)."""

    flat = True
    start_before_finish = False

    def __init__(self, servers, buckets: list[Bucket], version: int, *,
                 merged_adapters: bool = False):
        self.servers = servers
        self.buckets = buckets
        self.version = version
        self.merged_adapters = merged_adapters
        self.paused = False

    def start(self, bucket: Bucket, flat: torch.Tensor):
        s, cfg = self.servers, self.servers.config
        _, pg, backend = s.group.live
        if not self.paused and cfg.pause_generation:
            self.paused = True  # set first: a pause that half failed is still undone
            s.pause()
        last = bucket.index == len(self.buckets) - 1
        body = update_request(bucket, group_name=s.group.wire_name,
                              version=self.version if last else None,
                              flush_cache=last and cfg.flush_cache,
                              merged_adapters=self.merged_adapters)
        calls = {url: Call(lambda url=url: call(url, "/update_weights_from_distributed", body,
                                                timeout=cfg.timeout_s),
                           f"server {url}: /update_weights_from_distributed")
                 for url in s.urls}
        packed = pack(flat, bucket)
        work = broadcast(pg, packed)
        if cfg.on_bucket is not None:
            cfg.on_bucket(bucket.index, len(self.buckets))
        return bucket, calls, work, packed, backend, time.monotonic() + cfg.timeout_s

    def finish(self, handle) -> None:
        bucket, calls, work, packed, backend, deadline = handle
        wire = None
        try:
            wait_work(work, backend, deadline - time.monotonic())
        except Exception as exc:  # noqa: BLE001 - gloo raises RuntimeError, NCCL TimeoutError
            wire = f"{type(exc).__name__}: {exc}"
            deadline = min(deadline, time.monotonic() + 2.0)  # the servers may explain
        errors = []
        for c in calls.values():
            try:
                c.result(deadline)
            except WeightSyncError as exc:
                errors.append(str(exc))
        where = (f"[bucket {bucket.index} of {len(self.buckets)}, {len(bucket.specs)} tensors "
                 f"from {bucket.names[0]!r}, {bucket.nbytes} bytes]")
        if errors or wire:
            raise WeightSyncError("; ".join(errors or [f"broadcast to {self.servers.urls} "
                                                       f"failed: {wire}"]) + f" {where}; "
                                  f"SGLang's protocol applies each bucket on arrival, so the "
                                  f"servers that took this or earlier buckets hold part of "
                                  f"version {self.version} until a push succeeds")

    def conclude(self) -> None:
        """Generation resumes, then every server must report the pushed version."""
        self.resume(strict=True)
        check_versions(self.servers.urls, self.version, self.servers.config.timeout_s)

    def resume(self, *, strict: bool) -> None:
        if self.paused:
            self.paused = False
            self.servers.resume(strict=strict)

    def abandon(self) -> None:
        """After a failure: the group may be out of step (drop it); never leave generation
        paused."""
        self.servers.retire()
        self.resume(strict=False)


def check_versions(urls: Sequence[str], version: int, timeout: float) -> None:
    for url in urls:
        got = call(url, "/get_weight_version", timeout=timeout).get("weight_version")
        if got != str(version):
            raise WeightSyncError(f"server {url}: weight_version after the update must be "
                                  f"{str(version)!r}, got {got!r} (/get_weight_version)")


# ---------------------------------------------------------------- the log-prob probe


def probe_tokens(vocab_size: int, n: int = 8) -> list[int]:
    """A fixed prompt of ``n`` token ids inside the vocabulary."""
    return [(3 + 7 * i) % max(int(vocab_size), 1) for i in range(n)]


def probe_request(prompt: list[int]) -> dict:
    """A GenerateReqInput body: greedy (SGLang then reports log_softmax of the raw logits),
    a few new tokens with their log-probs."""
    return {"input_ids": list(prompt), "return_logprob": True, "stream": False,
            "sampling_params": {"max_new_tokens": PROBE_NEW_TOKENS, "temperature": 0.0,
                                "ignore_eos": True}}


def read_probe(url: str, answer: Any) -> tuple[list[int], list[float]]:
    """(output token ids, their log-probs) from a /generate answer; WeightSyncError when the
    answer lacks them."""
    if isinstance(answer, list) and len(answer) == 1:
        answer = answer[0]
    try:
        rows = answer["meta_info"]["output_token_logprobs"]
        ids = [int(r[1]) for r in rows]
        logps = [float(r[0]) for r in rows]
    except (KeyError, TypeError, IndexError, ValueError) as exc:
        raise WeightSyncError(f"server {url}: /generate with return_logprob must answer "
                              f"meta_info.output_token_logprobs as [logprob, token_id, text] "
                              f"rows, got {str(answer)[:200]} ({type(exc).__name__})") from None
    if not ids:
        raise WeightSyncError(f"server {url}: /generate must return at least one token for the "
                              f"log-prob probe, got none")
    return ids, logps


def run_probes(urls: Sequence[str], prompt: list[int], timeout: float) -> list[tuple]:
    """Rank 0: each server's (output ids, log-probs) for the probe prompt."""
    return [read_probe(url, call(url, "/generate", probe_request(prompt), timeout=timeout))
            for url in urls]


def compare_probe(url: str, prompt: list[int], ids: list[int], served: list[float],
                  ours: torch.Tensor, tol: float) -> None:
    """``ours``: the trainer's logp [T] of prompt + ids; the served log-probs must match it at
    the generated positions within ``tol``."""
    mine = ours[len(prompt):len(prompt) + len(ids)].double()
    theirs = torch.tensor(served, dtype=torch.float64)
    gap = float((mine - theirs).abs().max())
    if not gap <= tol:
        raise WeightSyncError(
            f"server {url}: log-probs of the probe (prompt {prompt}, tokens {ids}) must match "
            f"the trainer's forward_logp within probe_tol={tol:g}, got a gap of {gap:.4g} "
            f"(served {[round(v, 4) for v in served]}, trainer "
            f"{[round(v, 4) for v in mine.tolist()]}); the server does not serve the pushed "
            f"weights, and SGLang applied them without staging: push again or restart it")


def probe(state, urls: Sequence[str], dtype: torch.dtype, *, probe_tol: float | None,
          timeout_s: float) -> None:
    """Collective: each server's greedy log-probs on a fixed prompt against the trainer's
    forward_logp on the same tokens (``probe_tol``; None: 1e-3 for a float32 push, 0.1 for
    16-bit dtypes). Rank 0 asks the servers; every rank runs the forward."""
    from fsdpfn.agree import agree_on_error, capture_error, is_rank_zero, share_from_rank_zero

    prompt = probe_tokens(state.hf_config.vocab_size)
    probes, error = (capture_error(lambda: run_probes(urls, prompt, timeout_s),
                                   "probing the servers") if is_rank_zero() else (None, None))
    probes = share_from_rank_zero(probes, error)
    logp = _trainer_logp(state, [prompt + ids for ids, _ in probes])
    tol = probe_tol if probe_tol is not None else \
        (1e-3 if dtype == torch.float32 or dtype == torch.float64 else 0.1)
    error = None
    if is_rank_zero():
        _, error = capture_error(lambda: [compare_probe(url, prompt, out, served, logp[i], tol)
                                          for i, (url, (out, served)) in
                                          enumerate(zip(urls, probes))],
                                 "comparing the probe")
    agree_on_error(state.mesh, error)


def _trainer_logp(state, rows: list[list[int]]) -> torch.Tensor:
    """forward_logp of the token ``rows``, right-padded: logp[len(rows), longest row]."""
    from tensordict import TensorDict

    from fsdpfn.engine.forward import forward_logp

    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.int64)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
        mask[i, :len(r)] = True
    batch = TensorDict({"input_ids": ids, "attention_mask": mask}, batch_size=[len(rows)])
    return forward_logp(state, batch)["logp"]
