"""What trainer rank 0 knows of a RolloutTarget's servers, and its talk with them outside the
bytes of a push: which protocol they take (fsdpfn's update channel, or SGLang's), what they serve
(asked before a push that has no open channel to every server), the update group and the update
channels bound to it, pausing and resuming generation.

fsdpfn.rollout servers that offer an update channel are pushed to over it; every other server
(SGLang, or an fsdpfn.rollout server started without a channel) in SGLang's protocol.
"""

from __future__ import annotations

import urllib.parse
from typing import Sequence

import torch

from fsdpfn.errors import WeightSyncError
from fsdpfn.engine.state import EngineState
from fsdpfn.weights.channel import Channel
from fsdpfn.weights.push_config import PushConfig
from fsdpfn.weights.sglang import is_sglang
from fsdpfn.weights.update_group import UpdateGroup
from fsdpfn.wire.http import call
from fsdpfn.wire.model_fingerprint import config_fields, config_fingerprint, diff_config_fields

__all__ = ["Servers", "precheck", "check_config"]


class Servers:
    """Rank 0's view of the servers at ``urls`` (pushed to with ``config``)."""

    def __init__(self, urls: Sequence[str], config: PushConfig):
        self.urls = list(urls)
        self.config = config
        self.group = UpdateGroup(self.urls, config)
        self.sglang: bool | None = None  # whether they are SGLang's servers (None: not asked)
        # url -> (trainer layout hash, /get_model_info answer) of the last prepare
        self.infos: dict[str, tuple[int, dict]] = {}
        # url -> its update channel (bound to the live group)
        self.channels: dict[str, Channel] = {}
        self._unreachable: set[tuple] = set()  # (url, server_id, port) whose channel failed
        self._prepared: tuple[str, str, bool] | None = None  # the last push's preparation
        self.last_apply_s: float | None = None  # the servers' own seconds applying the last push

    # ------------------------------------------------------------ before a push

    def prepare(self, state: EngineState, params, layout: tuple) -> tuple[str, str, bool]:
        """(push dtype name, backend, whether the push goes in SGLang's protocol); checks
        names/shapes and the model's config (``precheck``); (re)builds the group if needed.

        With an update channel to every server (fsdpfn.rollout), a push whose layout was seen
        before costs no request at all: each channel is open, which shows the server is up and
        still holds the group (it closes the channel when it drops the group, and the OS closes
        it when the server exits). Otherwise one /get_model_info per server: what it serves,
        its server_id and groups (fsdpfn.rollout's), and the precheck against it."""
        layout = hash(layout)
        if self._ready(layout):
            return self._prepared
        self._prepared, self.last_apply_s = None, None
        for url in [u for u, ch in self.channels.items() if ch.stale()]:
            self.channels.pop(url).close()
        infos = self._model_infos(layout)
        _check_distinct(infos)
        self.sglang = _speak_sglang(infos)
        if self.sglang:
            return self._prepare_sglang(state)
        dtype = self._push_dtype(infos)
        if self.config.precheck:
            self._precheck(infos, params, dtype, getattr(state, "hf_config", None))
        on_cuda = state.mesh.device_type == "cuda" and all(
            str(info.get("device", "cpu")).startswith("cuda") for info in infos.values())
        backend = self.config.backend or ("nccl" if on_cuda else "gloo")
        if self.config.transport == "broadcast":
            stale = self.group.live is None or self.group.live[2] != backend or any(
                self.config.group_name not in i.get("groups", ()) for i in infos.values())
            if stale:
                self._build_group(backend, state.mesh.device)
            self.open_channels(infos)
            if self.over_channels():
                self._prepared = (dtype, backend, False)
            else:  # a server without a (reachable) channel: all in SGLang's protocol
                for ch in self.channels.values():
                    ch.close()
                self.channels.clear()
        return dtype, backend, self.config.transport == "broadcast" and not self.over_channels()

    def _ready(self, layout: int) -> bool:
        """Whether the last preparation still holds: an open channel to every server, bound to
        the live group, and the same trainer layout."""
        return (self._prepared is not None and self.group.live is not None
                and self.config.transport == "broadcast" and bool(self.channels)
                and all(url in self.channels and not self.channels[url].stale()
                        and self.infos.get(url, (None, None))[0] == layout
                        for url in self.urls))

    def _model_infos(self, layout: int) -> dict[str, dict]:
        """Each server's /get_model_info, kept with the trainer layout it was asked for."""
        for url in self.urls:
            info = call(url, "/get_model_info", timeout=self.config.timeout_s)
            self.infos[url] = (layout, info)
        return {url: self.infos[url][1] for url in self.urls}

    def _push_dtype(self, infos: dict[str, dict]) -> str:
        served = {url: info.get("dtype") for url, info in infos.items()}
        if self.config.dtype is not None:
            return self.config.dtype
        if len(set(served.values())) == 1:
            return next(iter(served.values()))
        raise WeightSyncError(f"dtype: the servers serve different dtypes {served}; pass "
                              f"one explicitly: RolloutTarget(urls, "
                              f"config=PushConfig(dtype=...))")

    def _precheck(self, infos: dict[str, dict], params, dtype: str, hf_config) -> None:
        for url, info in infos.items():
            try:
                precheck(url, info, params, dtype, hf_config=hf_config)
            except WeightSyncError:
                self.infos.pop(url, None)  # look again next time
                raise

    def _prepare_sglang(self, state: EngineState) -> tuple[str, str, bool]:
        """SGLang reports no parameters and no dtype: the push dtype is ``dtype`` or the
        trainer's compute dtype, and nothing is prechecked (the probe checks afterwards). Its
        model info shows no groups: the group is kept until a failure retires it."""
        cfg = self.config
        if cfg.transport == "ipc":
            raise WeightSyncError("transport: 'ipc' needs fsdpfn.rollout servers "
                                  "(/update_weights_from_ipc); SGLang servers take "
                                  "'broadcast' or 'disk', got 'ipc'")
        dtype = cfg.dtype or state.config.dtype
        backend = cfg.backend or ("nccl" if state.mesh.device_type == "cuda" else "gloo")
        if cfg.transport == "broadcast" and (self.group.live is None
                                             or self.group.live[2] != backend):
            self._build_group(backend, state.mesh.device)
        return dtype, backend, True

    def _build_group(self, backend: str, device: torch.device) -> None:
        self.retire()
        self.group.build(backend, device, sglang=bool(self.sglang))

    def open_channels(self, infos: dict[str, dict]) -> None:
        """An update channel to every server that offers one (bound to the live group). A server
        whose channel cannot be reached is pushed to in SGLang's protocol."""
        for url, info in infos.items():
            port = info.get("update_channel")
            unreachable = (url, info.get("server_id"), port)
            if url in self.channels or not port or unreachable in self._unreachable:
                continue
            host = urllib.parse.urlparse(url).hostname or "127.0.0.1"
            try:
                self.channels[url] = Channel(url, host, int(port), self.config.group_name,
                                             min(self.config.timeout_s, 10.0))
            except WeightSyncError as exc:  # this push goes in SGLang's protocol
                if getattr(exc, "unreachable", False):
                    # not tried again for this server process (a firewalled port would cost a
                    # connection timeout per push)
                    self._unreachable.add(unreachable)

    def over_channels(self) -> bool:
        """Whether this push goes over an update channel to every server."""
        return bool(self.channels) and all(url in self.channels for url in self.urls)

    # ------------------------------------------------------------ generation

    def pause(self) -> None:
        if self.config.pause_generation:
            body = {"mode": self.config.pause_mode} if self.sglang else {}
            for url in self.urls:
                call(url, "/pause_generation", body, timeout=self.config.timeout_s)

    def resume(self, *, strict: bool) -> None:
        """/continue_generation on every server; with ``strict``, a failure raises (after every
        server was asked)."""
        if not self.config.pause_generation:
            return
        errors = []
        for url in self.urls:
            try:
                call(url, "/continue_generation", {}, timeout=min(self.config.timeout_s, 30.0))
            except WeightSyncError as exc:
                errors.append(str(exc))
        if errors and strict:
            raise WeightSyncError("; ".join(errors))

    # ------------------------------------------------------------ the group's end

    def retire(self) -> None:
        """Stop using the current group and its channels (the next push builds a new one)."""
        self._prepared = None
        for ch in self.channels.values():
            ch.close()
        self.channels.clear()
        self.group.retire()

    def close(self) -> None:
        """Ask the servers to drop the group (best effort) and forget it."""
        if self.group.live is not None:
            self.group.destroy_on_servers()
            self.retire()


def _check_distinct(infos: dict[str, dict]) -> None:
    """Two URLs of one server (``http://127.0.0.1:P`` and ``http://localhost:P``) are refused
    before anything is sent: the server would be asked to join the update group twice, and the
    group would wait for a member that never comes. fsdpfn.rollout servers name themselves in
    /get_model_info (``server_id``, new at each start); a server that does not is not checked."""
    seen: dict = {}
    for url, info in infos.items():
        server_id = info.get("server_id") if isinstance(info, dict) else None
        if server_id is None:
            continue
        if server_id in seen:
            raise WeightSyncError(f"urls: {seen[server_id]!r} and {url!r} are one server "
                                  f"(server_id {server_id}); name each server once")
        seen[server_id] = url


def _speak_sglang(infos: dict[str, dict]) -> bool:
    kinds = {url: is_sglang(info) for url, info in infos.items()}
    if len(set(kinds.values())) > 1:
        raise WeightSyncError(f"urls: the servers must all be fsdpfn.rollout servers or all "
                              f"SGLang servers, got SGLang for {kinds}")
    return next(iter(kinds.values()))


def precheck(url: str, info: dict, params, dtype: str, *, hf_config=None) -> None:
    """The trainer's names, shapes and push dtype against a server's /get_model_info; then,
    when the server reports a ``config_fingerprint`` (fsdpfn.rollout servers do; SGLang and
    older fsdpfn servers do not, and are not checked), the trainer's ``hf_config`` against it
    (check_config)."""
    served = info.get("params") or {}
    ours = {name: list(p.shape) for name, p in params}
    problems = []
    unknown = [n for n in ours if n not in served]
    missing = [n for n in served if n not in ours]
    if unknown:
        problems.append(f"tensor {unknown[0]!r}: name must be a parameter of the served model, "
                        f"got {len(unknown)} unknown names (e.g. {unknown[:3]})")
    if missing:
        problems.append(f"tensor {missing[0]!r}: the served model has it, the trainer does not "
                        f"({len(missing)} such, e.g. {missing[:3]})")
    for name, shape in ours.items():
        if name in served and list(served[name]["shape"]) != shape:
            problems.append(f"tensor {name!r}: shape must equal the served "
                            f"{served[name]['shape']}, got {shape}")
        if name in served and served[name]["dtype"] != dtype:
            problems.append(f"tensor {name!r}: dtype must equal the served "
                            f"{served[name]['dtype']}, got {dtype}")
    if problems:
        more = f"; ... {len(problems) - 4} more" if len(problems) > 4 else ""
        raise WeightSyncError(f"server {url}: the trainer's weights do not match the served "
                              f"model ({info.get('model_path')}): " + "; ".join(problems[:4])
                              + more)
    if hf_config is not None:
        check_config(url, info, hf_config)


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_config(url: str, info: dict, hf_config) -> None:
    """The trainer's model config against a server's: the same tensors under another family or
    config (rope_theta, a sliding window, norm eps, softcaps, scales) compute other log-probs,
    so a push there would be accepted and then serve a model the trainer never trained.

    Compares the fingerprint of fsdpfn.wire.model_fingerprint (the trainer's from
    ``hf_config``, the server's from its /get_model_info) and, when they differ, raises a
    WeightSyncError naming each differing field with both values. A server that reports no
    fingerprint is not checked."""
    theirs = info.get("config_fingerprint")
    if not theirs:
        return
    ours = config_fields(hf_config)
    if config_fingerprint(ours) == theirs:
        return
    served = info.get("config_fields")
    served = served if isinstance(served, dict) else {}
    problems = []
    for name in diff_config_fields(ours, served):
        if name not in served:
            problems.append(f"config.{name}: the trainer's config has {_shown(ours[name])}, "
                            f"the served model's has none")
        elif name not in ours:
            problems.append(f"config.{name}: the served model's config has "
                            f"{_shown(served[name])}, the trainer's has none")
        else:
            problems.append(f"config.{name} must equal the trainer's {_shown(ours[name])}, "
                            f"got {_shown(served[name])}")
    if not problems:  # a server that reports the fingerprint alone
        problems.append(f"config_fingerprint must equal the trainer's "
                        f"{config_fingerprint(ours)}, got {theirs}")
    more = f"; ... {len(problems) - 4} more" if len(problems) > 4 else ""
    raise WeightSyncError(f"server {url}: " + "; ".join(problems[:4]) + more
                          + f" (the served model {info.get('model_path')} has the trainer's "
                          f"tensor names and shapes but another family or config, so the "
                          f"same weights would compute other log-probs there; serve the "
                          f"trainer's config.json, or pass PushConfig(precheck=False) to "
                          f"push anyway)")
