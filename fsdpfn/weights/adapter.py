"""AdapterTarget: push the LoRA adapters alone (a few MB) to rollout servers, over a shared disk.

    target = AdapterTarget("http://127.0.0.1:30000", root="/shared/adapters", lora_name="policy")
    receipt = ff.push_weights(state, target)     # state built with EngineConfig.lora

Per push (collective): every rank takes part in gathering the adapters whole; trainer rank 0
writes peft's adapter directory ``root/v{version}`` (adapter_model.safetensors,
adapter_config.json; written aside and renamed in) and posts SGLang's /load_lora_adapter
{lora_name, lora_path, weight_version} to each server. A server that refuses because it already
holds the name (SGLang refuses so) is sent /unload_lora_adapter {lora_name} and the load once
more; any other refusal is raised, the server left as it was. SGLang then serves requests that
name ``lora_name`` (its ``lora_path`` field of /generate); fsdpfn's built-in server merges the
adapter into the weights it serves, for every request (fsdpfn.rollout.lora), and answers with
the pushed version. The ``keep_last`` most recently published directories are kept (this push's
among them). Any failure raises WeightSyncError on every trainer rank.

To push merged weights instead (base + adapters folded in, under the base names, to any
server), push a LoRA state to a RolloutTarget or DiskTarget as usual. Use one way per server:
the built-in server refuses to load an adapter on weights a merged push sent (it would count
the adapters twice); SGLang cannot tell, so never mix the two on one SGLang server.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Sequence

from fsdpfn.engine import lora
from fsdpfn.errors import ConfigError, WeightSyncError
from fsdpfn.validators import check_dir
from fsdpfn.engine.state import EngineState
from fsdpfn.agree import capture_error, is_rank_zero, share_from_rank_zero
from fsdpfn.weights.disk import keep_recent
from fsdpfn.wire.http import call, check_urls
from fsdpfn.wire.protocol import dtype_from_name

__all__ = ["AdapterTarget"]


class AdapterTarget:
    """Push a LoRA state's adapters to ``urls`` through directories under ``root`` (which the
    servers read at the same path). ``dtype``: the adapters' dtype on disk (float32 default)."""

    def __init__(self, urls: str | Sequence[str], *, root: str | os.PathLike,
                 lora_name: str = "fsdpfn", dtype: str = "float32", keep_last: int = 2,
                 timeout_s: float = 300.0):
        urls = check_urls(urls)
        if not isinstance(lora_name, str) or not lora_name:
            raise ConfigError(f"lora_name: must be a non-empty string, got {lora_name!r}")
        if not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1:
            raise ConfigError(f"keep_last: must be an int >= 1, got {keep_last!r}")
        if not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ConfigError(f"timeout_s: must be a number > 0, got {timeout_s!r}")
        try:
            self.dtype = dtype_from_name(dtype)
        except ValueError as exc:
            raise ConfigError(f"dtype: {exc}") from None
        self.urls = urls  # check_urls strips trailing slashes
        self.root = check_dir("root", root)
        self.lora_name = lora_name
        self.keep_last = keep_last
        self.timeout_s = float(timeout_s)

    def __repr__(self) -> str:
        return f"AdapterTarget({self.urls!r}, root={str(self.root)!r})"

    def push(self, state: EngineState) -> tuple[int, int]:
        if state.config.lora is None:
            raise WeightSyncError("push_weights: AdapterTarget needs a state built with "
                                  "EngineConfig.lora, got one without adapters (push full "
                                  "weights with a RolloutTarget)")
        pusher = is_rank_zero()
        tensors = lora.gather_adapters(state.model, device=state.mesh.device, keep=pusher)
        n_bytes = sum(t.numel() * self.dtype.itemsize for t in tensors.values())
        error = None
        if pusher:
            _, error = capture_error(lambda: self._publish_and_load(state, tensors),
                                  "publishing the adapters")
        share_from_rank_zero(None, error)
        return len(lora.adapter_params(state.model)), n_bytes

    def _publish_and_load(self, state: EngineState, tensors: dict) -> None:
        final = self.root / f"v{state.version}"
        tmp = self.root / f".tmp-v{state.version}-{uuid.uuid4().hex[:8]}"
        source = state.config.model_path
        config = lora.peft_config(state.config.lora, state.model.lm,
                                  base_path=None if source is None else str(Path(source).resolve()))
        try:
            lora.write_adapter_dir(tmp, tensors, config, self.dtype)
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        for url in self.urls:
            self._load(url, final, state.version)
        self._rotate(final)

    def _load(self, url: str, path: Path, version: int) -> None:
        payload = {"lora_name": self.lora_name, "lora_path": str(path), "weight_version": version}
        try:
            answer = call(url, "/load_lora_adapter", payload, timeout=self.timeout_s)
        except WeightSyncError as first:
            # SGLang refuses a name it holds ("LoRA with name ... already exists"): unload it and
            # load again. Any other refusal leaves the server serving what it served
            if "already" not in str(first):
                raise
            try:
                call(url, "/unload_lora_adapter", {"lora_name": self.lora_name},
                     timeout=self.timeout_s)
            except WeightSyncError:
                raise first from None
            answer = call(url, "/load_lora_adapter", payload, timeout=self.timeout_s)
        if answer.get("success") is False:
            raise WeightSyncError(f"server {url}: /load_lora_adapter failed: "
                                  f"{answer.get('error_message')}")
        served = answer.get("weight_version")
        if served is not None and served != version:
            raise WeightSyncError(f"server {url}: /load_lora_adapter: weight_version must be the "
                                  f"pushed {version}, got {served!r}")

    def _rotate(self, current: Path) -> None:
        """All but the ``keep_last`` most recently published adapters deleted (this one kept)."""
        versions = [(int(p.name[1:]), p) for p in self.root.glob("v*")
                    if p.is_dir() and p.name[1:].isdigit()
                    and (p / "adapter_config.json").is_file()]
        keep_recent(versions, self.keep_last, current, "adapter_config.json")
