"""The server's weight receiver: the one owner of a rollout server's update state (its
weights-update groups, the update channels bound to them, the turn that lets one update run at a
time, the last failure, the adapter merged in). It receives and checks weights and hands the
engine finished tensors through one locked swap (RolloutEngine.swap); any failure leaves the
served weights and version as they were.

Two ways in, each the protocol of its owner:

- SGLang's (/init_weights_update_group, /update_weights_from_distributed): the group is formed
  as SGLang's init_custom_process_group forms it (fsdpfn.wire.protocol.make_group; the trainer
  is rank 0, this server joins at ``rank_offset``); each request is a self-contained update of
  the tensors it names, with ``load_format="flattened_bucket"`` ONE broadcast of the tensors
  packed back to back (else one broadcast per tensor), loaded at once, as SGLang loads them.
  ``weight_version`` may be any string: it is reported back as given (/get_weight_version),
  beside fsdpfn's own integer version (staging.parse_version); ``abort_all_requests`` ends
  every generation first, as SGLang's does (also on the IPC and disk updates).
- fsdpfn's update channel (fsdpfn.rollout.channel serves its connections): whole updates
  (Receiver.update), each checked as it lands and swapped in only when the trainer commits.

Besides: CUDA IPC handles (/update_weights_from_ipc), files (/update_weights_from_disk), and
peft adapters merged in (/load_lora_adapter, fsdpfn.rollout.lora).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import attrs
import torch

from fsdpfn.rollout import lora as rollout_lora
from fsdpfn.rollout.errors import (UpdateError, check_flags, group_args, group_name,
                                   request_timeout)
from fsdpfn.rollout.staging import (Abandoned, Layout, checked_checksum, checksum_after,
                                    copy_shared, first_non_finite, http_swap_s,
                                    load_update_files, parse_version, post_flat, receive_sglang,
                                    record_event, request_fields, swap_bound,
                                    torch_dtypes, unpack_flat, validate, wait_events,
                                    wait_work_or_abandon)
from fsdpfn.wire.protocol import make_group

__all__ = ["Receiver", "Group"]


@attrs.frozen
class Group:
    """A weights-update group this server joined: (store, process group, backend, timeout)."""

    store: object
    pg: object
    backend: str
    timeout_s: float


class Receiver:
    """The update state of ``engine`` (a RolloutEngine) and every way weights come in."""

    def __init__(self, engine):
        self.engine = engine
        self.groups: dict[str, Group] = {}
        self.retired: list = []  # groups (and buffers) left mid-operation: kept alive
        self.adapter = None  # the adapter merged in, if any (fsdpfn.rollout.lora)
        # the version of the served weights when a whole update sent them as a LoRA trainer's
        # merged weights (its adapters already in them): no adapter may be loaded on top
        self.merged_push: int | None = None
        # a whole update loaded and checked, waiting for /update_weights_commit (disk pushes
        # to several servers: every server stages, then every server swaps)
        self.staged: dict | None = None
        self.last_error: str | None = None
        self.channel_port: int | None = None  # the update channel's port, when one listens
        self._channels: dict[str, list] = {}  # group name -> channel sockets bound to it
        self._channels_lock = threading.Lock()
        self._turn = threading.Lock()  # one update or group change at a time
        self._stream = None  # the CUDA stream that checks received buckets (lazily)

    def info(self) -> dict:
        return {"groups": sorted(self.groups), "last_error": self.last_error,
                "update_channel": self.channel_port}

    # ------------------------------------------------------------ turns and failures

    @contextlib.contextmanager
    def _alone(self, wait_s: float, drop_on_busy: str | None = None):
        """No other update or group change runs meanwhile (409 after ``wait_s``; with
        ``drop_on_busy``, that group is dropped first: the bytes sent for a request that never
        got the turn are unread); an UpdateError is recorded, and generation resumed, before it
        is raised."""
        if not self._turn.acquire(timeout=max(wait_s, 0.0)):
            note = ""
            if drop_on_busy is not None:
                self._drop_group(drop_on_busy)
                note = (f"; group {drop_on_busy!r} dropped (the bytes sent for this request are "
                        f"unread), re-initialise it")
            raise UpdateError("update: another update is in progress" + note, 409)
        try:
            yield
        except UpdateError as exc:
            self.last_error = str(exc)
            self.engine.resume()  # a failed update never leaves generation paused
            raise
        finally:
            self._turn.release()

    def _group(self, name) -> Group:
        group = self.groups.get(str(name))
        if group is None:
            raise UpdateError(f"group_name: no weights-update group {name!r} on this server "
                              f"(groups: {sorted(self.groups)}); call /init_weights_update_group "
                              f"first", 404)
        return group

    def _drop_group(self, name: str, *keep) -> None:
        """Forget a group (kept alive with ``keep``: an operation may still use them) and close
        the update channels bound to it, so their trainers learn they must set up again."""
        group = self.groups.pop(name, None)
        self.retired.extend([g for g in (group, *keep) if g is not None])
        with self._channels_lock:
            sockets = self._channels.pop(name, [])
        for sock in sockets:
            _shut(sock)

    def _swap(self, tensors: dict, version: int, label, *, whole: bool,
              merged_adapters: bool = False, timeout_s: float = 300.0) -> None:
        """Hand the engine checked tensors (HF names, aliases resolved). The tensors are the
        new base: a whole update drops the adapter merged in, a partial one drops it from the
        weights it replaces (unloading then leaves them as sent). ``merged_adapters``: a LoRA
        trainer's merged weights (a whole update, or SGLang's requests of one), on which no
        adapter may be loaded."""
        canonical = {self.engine.aliases.get(n, n): t for n, t in tensors.items()}
        self.engine.swap(canonical, version, label=label, timeout_s=timeout_s)
        if whole:
            self.staged = None  # staged against the weights this update replaces
            self.adapter = None
            self.merged_push = version if merged_adapters else None
        else:
            if merged_adapters:  # a LoRA trainer's merged weights, sent in SGLang's requests
                self.merged_push = version
            if self.adapter is not None:
                self.adapter.base = {n: t for n, t in self.adapter.base.items()
                                     if n not in canonical}
                if not self.adapter.base:
                    self.adapter = None
        self.last_error = None

    def _abort_if_asked(self, payload: dict) -> None:
        """SGLang's ``abort_all_requests``: every generation ends now (finish_reason "abort")."""
        if payload.get("abort_all_requests"):
            self.engine.abort(abort_all=True)

    def _version(self, value, *, partial: bool = False) -> tuple[int, str | None]:
        return parse_version(value, self.engine.version, self.engine.version_label(),
                             partial=partial)

    # ------------------------------------------------------------ groups (SGLang's request)

    def init_group(self, payload: dict) -> dict:
        """/init_weights_update_group: SGLang's {master_address, master_port, rank_offset,
        world_size, group_name="weight_update_group", backend="nccl"}, plus fsdpfn's timeout_s
        (default 300). Joins as rank ``rank_offset``; blocks until every member joined."""
        args = group_args(payload)
        name, backend = args["group_name"], args["backend"]
        if backend == "nccl" and self.engine.device.type != "cuda":
            raise UpdateError(f"backend: 'nccl' needs a server on cuda, this one serves on "
                              f"{self.engine.device}; pass backend='gloo'")
        with self._alone(args["timeout_s"]):
            self._drop_group(name)
            try:
                store, pg = make_group(device=self.engine.device, **args)
            except Exception as exc:  # noqa: BLE001 - rendezvous failures come in many types
                raise UpdateError(f"init_weights_update_group {name!r}: joining "
                                  f"{args['master_address']}:{args['master_port']} as rank "
                                  f"{args['rank']} of {args['world_size']} failed: "
                                  f"{type(exc).__name__}: {exc}", 500) from None
            self.groups[name] = Group(store, pg, backend, args["timeout_s"])
        return {"success": True, "message": f"joined group {name!r}"}

    def destroy_group(self, payload: dict) -> dict:
        """/destroy_weights_update_group: {group_name="weight_update_group"}."""
        with self._alone(60.0):
            self._drop_group(group_name(payload))
        return {"success": True, "message": "group dropped"}

    def attach_channel(self, group_name: str, sock) -> None:
        """Bind an update channel connection to a group: closed when the group is dropped."""
        with self._channels_lock:
            self._group(group_name)
            self._channels.setdefault(group_name, []).append(sock)

    def detach_channel(self, sock) -> None:
        with self._channels_lock:
            for sockets in self._channels.values():
                if sock in sockets:
                    sockets.remove(sock)

    # ------------------------------------------------------------ SGLang's update request

    def update_from_distributed(self, payload: dict) -> dict:
        """/update_weights_from_distributed, SGLang's UpdateWeightsFromDistributedReqInput:
        {names, dtypes, shapes, group_name="weight_update_group", flush_cache, weight_version
        (any string), load_format ("flattened_bucket": one packed broadcast)}: the named tensors
        received, checked (known, shapes, dtypes, finite) and swapped in at once. A request the
        server refuses after its bytes were sent takes them, so the group stays in step; one
        refused before (its fields cannot size the bytes, or another update holds the turn)
        drops the group, so the bytes sent for it are never read as the next request's.
        ``merged_adapters`` (fsdpfn's): a LoRA trainer's merged weights (no adapter on top)."""
        name = group_name(payload)
        group = self._group(name)
        try:
            check_flags(payload)
            request_timeout(payload)  # refused before any byte is read, not after
            names, dtypes, shapes = request_fields(payload)
            self._version(payload.get("weight_version"), partial=True)  # refused before bytes
        except UpdateError as exc:
            self._drop_group(name)
            self.last_error = f"{exc}; group {name!r} dropped, re-initialise it"
            raise UpdateError(self.last_error, exc.status) from None
        self._abort_if_asked(payload)
        with self._alone(group.timeout_s, drop_on_busy=name):
            return self._apply_request(payload, name, group, names, dtypes, shapes)

    def _apply_request(self, payload: dict, name: str, group: Group, names, dtypes,
                       shapes) -> dict:
        """One SGLang request's tensors received, checked and swapped in (turn held)."""
        clock = time.perf_counter()
        tensors = self._receive_request(name, group, names, dtypes, shapes,
                                        payload.get("load_format") == "flattened_bucket")
        received = time.perf_counter()
        version, label = self._version(payload.get("weight_version"), partial=True)
        self._swap(tensors, version, label, whole=False,
                   merged_adapters=bool(payload.get("merged_adapters")),
                   timeout_s=group.timeout_s)
        return {"success": True, "message": f"updated {len(names)} tensors",
                "weight_version": version, "seconds": {
                    "receive": received - clock, "apply": time.perf_counter() - received}}

    def _receive_request(self, name: str, group: Group, names, dtypes, shapes, packed: bool):
        """The tensors of one SGLang request, received then checked."""
        try:
            typed = torch_dtypes(dtypes)
            if packed and len(set(typed)) > 1:
                raise UpdateError(f"dtypes: a flattened_bucket packs one dtype, got "
                                  f"{sorted(set(dtypes))}")
        except UpdateError as exc:  # the bytes cannot be sized: the group is out of step
            self._drop_group(name)
            raise UpdateError(f"{exc}; group {name!r} dropped, re-initialise it") from None
        params, aliases = self.engine.params, self.engine.aliases
        problems = validate(params, aliases, names, typed, shapes, whole=False)
        try:
            received = receive_sglang(group.pg, group.backend, group.timeout_s,
                                      self.engine.device, packed, typed, shapes)
        except Exception as exc:  # noqa: BLE001 - a dead or stalled sender: gloo/nccl errors
            self._drop_group(name)
            raise UpdateError(f"receiving over group {name!r} failed: {type(exc).__name__}: "
                              f"{exc}; group dropped, previous weights kept", 500) from None
        tensors = dict(zip(names, received))
        problems = problems or [f"tensors must be finite, got NaN/inf in {bad}"
                                for bad in [first_non_finite(tensors)] if bad]
        if problems:
            raise UpdateError("update rejected, previous weights kept: " + "; ".join(problems))
        return tensors

    # ------------------------------------------------------------ a whole update (channel)

    def update(self, message: dict, layout: Layout | None = None, ack=None,
               decide=None, abandoned=None) -> dict:
        """A whole update: {buckets: [{names, dtypes, shapes}, ...] (or its parsed ``layout``),
        group_name, weight_version}, one aligned flat broadcast per bucket (fsdpfn.wire
        .protocol's layout). Refused before any byte is sent when it cannot be committed;
        ``ack()`` is called once it is accepted (the sender then broadcasts). ``decide(ready,
        timeout_s)``, when given, is handed {weight_version, weights_checksum} of what arrived
        and checked, and returns whether the sender commits it: the weights are swapped in
        only then, within what the sender waits for the answer (swap_bound). ``abandoned()``
        true while the bytes are awaited (the sender closed its channel: it failed elsewhere)
        ends the wait at once, so this server's turn is free for the sender's next push."""
        name = str(message.get("group_name"))
        group = self._group(name)
        with self._alone(group.timeout_s):
            if layout is None:
                layout = Layout(self.engine.params, self.engine.aliases, message.get("buckets"))
            if layout.problems:
                raise UpdateError("update refused before any byte was sent, previous weights "
                                  "kept: " + "; ".join(layout.problems))
            version, label = self._version(message.get("weight_version"))
            if ack is not None:
                ack()
            clock = time.perf_counter()
            tensors, sums, finite = self._receive_whole(name, group, layout, abandoned)
            return self._commit(tensors, sums, finite, version, label, clock,
                                decide=None if decide is None else
                                (lambda ready: decide(ready, group.timeout_s)),
                                merged_adapters=bool(message.get("merged_adapters")),
                                swap_s=swap_bound(group.timeout_s))

    def _receive_whole(self, name: str, group: Group, layout: Layout, abandoned=None):
        """Every bucket's receive posted at once (the sender keeps several in flight), each
        bucket unpacked and checked as it lands; over NCCL on a side stream (the host waits
        once, for the last). Returns (tensors, [(names, checksums)], [finite flags])."""
        nccl = group.backend == "nccl"
        device = self.engine.device if nccl else torch.device("cpu")
        tensors, sums, finite, done, posted = {}, [], [], [], []
        try:
            if nccl and self._stream is None:
                self._stream = torch.cuda.Stream(self.engine.device)
            posted = [post_flat(group.pg, device, b.total) for b in layout.buckets]
            for b, names, (buf, work) in zip(layout.buckets, layout.canonical, posted):
                if nccl:
                    with torch.cuda.stream(self._stream):
                        work.wait()  # the side stream waits for the bytes; the host does not
                        out, s, f = unpack_flat(buf, b)
                    done.append(record_event(self._stream))
                else:
                    wait_work_or_abandon(work, group.backend, group.timeout_s, abandoned)
                    out, s, f = unpack_flat(buf.to(self.engine.device), b)
                tensors.update(zip(names, out))
                sums.append((names, s))
                finite.append(f)
            wait_events(done, group.timeout_s, abandoned)
        except Exception as exc:  # noqa: BLE001 - a dead, stalled or departed sender
            self._drop_group(name, posted)  # buffers may still be written: keep them alive
            if nccl:
                self._stream = None  # it waits on receives that may never complete
            if isinstance(exc, Abandoned):
                raise UpdateError(f"receiving over group {name!r}: {exc}; group dropped, "
                                  f"previous weights kept", 409) from None
            raise UpdateError(f"receiving over group {name!r} failed: {type(exc).__name__}: "
                              f"{exc}; group dropped, previous weights kept", 500) from None
        return tensors, sums, finite

    # ------------------------------------------------------------ IPC, disk, adapters

    def update_from_ipc(self, payload: dict) -> dict:
        """/update_weights_from_ipc: {buckets: [{names, dtypes, shapes, handle}],
        weight_version, flush_cache}: each bucket an aligned flat bucket (the update channel's
        layout) in a device buffer of a process on this GPU, named by its CUDA IPC handle
        (fsdpfn.wire.ipc); copied into memory of this server, checked on the device and swapped
        in like a whole update. The sender frees its buffers after the answer. fsdpfn's sender
        adds ``weights_checksum`` (what arrived must have it, else refused before the swap) and
        ``timeout_s`` (its call's: the swap waits for the model lock a little less)."""
        check_flags(payload)
        request_timeout(payload)  # refused before the update is read, not after
        if self.engine.device.type != "cuda":
            raise UpdateError(f"update_weights_from_ipc: needs a server on a GPU, and this one "
                              f"runs on {self.engine.device}")
        start = time.monotonic()
        self._abort_if_asked(payload)
        with self._alone(0.0):
            layout = Layout(self.engine.params, self.engine.aliases, payload.get("buckets"))
            if layout.problems:
                raise UpdateError("update rejected, previous weights kept: "
                                  + "; ".join(layout.problems))
            version, label = self._version(payload.get("weight_version"))
            clock = time.perf_counter()
            tensors, sums, finite = {}, [], []
            for spec, b, names in zip(payload["buckets"], layout.buckets, layout.canonical):
                out, s, f = copy_shared(spec.get("handle"), b, self.engine.device)
                tensors.update(zip(names, out))
                sums.append((names, s))
                finite.append(f)
            torch.cuda.synchronize(self.engine.device)  # copies done before the sender frees
            return self._commit(tensors, sums, finite, version, label, clock,
                                merged_adapters=bool(payload.get("merged_adapters")),
                                swap_s=http_swap_s(payload, start),
                                expected=payload.get("weights_checksum"))

    def _commit(self, tensors, sums, finite, version, label, clock: float,
                decide=None, merged_adapters: bool = False, swap_s: float = 300.0,
                expected=None) -> dict:
        """A whole update that arrived: checked (with ``expected``: its checksum must be the
        sender's), (with ``decide``: committed by the sender), swapped in within ``swap_s``,
        answered with its timings."""
        received = time.perf_counter()
        checksum = checked_checksum(tensors, sums, finite)
        if expected is not None and checksum != expected:
            raise UpdateError(f"weights_checksum: what arrived must have the sender's checksum "
                              f"{expected}, got {checksum}; previous weights kept", 409)
        checked = time.perf_counter()
        if decide is not None and not decide({"weight_version": version,
                                              "weights_checksum": checksum}):
            raise UpdateError("update not committed by the trainer (it failed after the last "
                              "byte, or the checksum differed), previous weights kept", 409)
        decided = time.perf_counter()  # the wait for the decision is neither receive nor apply
        self._swap(tensors, version, label, whole=True, merged_adapters=merged_adapters,
                   timeout_s=swap_s)
        return {"success": True, "weight_version": version, "weights_checksum": checksum,
                "message": f"updated {len(tensors)} tensors to version {version}",
                "seconds": {"receive": received - clock,
                            "apply": checked - received + time.perf_counter() - decided}}

    def update_from_disk(self, payload: dict) -> dict:
        """/update_weights_from_disk: {model_path, weight_version, flush_cache, load_format,
        verify_checksums (default true: sha256 of each tensor against fsdpfn_manifest.json),
        merged_adapters, commit (default true; false: load and check the files, keep them
        staged and answer their checksum, the served weights untouched until
        /update_weights_commit), timeout_s (fsdpfn's senders: their call's, which bounds the
        swap's wait for the model lock)}. With fsdpfn's manifest the version is the manifest's
        (a label given beside it names that version)."""
        start = time.monotonic()
        check_flags(payload)
        request_timeout(payload)  # refused before the update is read, not after
        self._abort_if_asked(payload)
        with self._alone(0.0):
            tensors, version, label = load_update_files(
                payload, self.engine.params, self.engine.aliases, self.engine.device,
                self._version)
            merged = bool(payload.get("merged_adapters"))
            if payload.get("commit", True) is False:
                return self._stage(tensors, version, label, merged)
            return self._commit_loaded(tensors, version, label, merged_adapters=merged,
                                       swap_s=http_swap_s(payload, start))

    def _stage(self, tensors: dict, version: int, label, merged: bool) -> dict:
        """Keep a checked whole update aside (replacing any staged before); answer with the
        checksum the weights will have once it is committed."""
        bad = first_non_finite(tensors)
        if bad:
            raise UpdateError(f"update rejected, previous weights kept: tensors must be finite, "
                              f"got NaN/inf in {bad}")
        checksum = checksum_after(self.engine.params, self.engine.aliases, tensors)
        self.staged = {"tensors": tensors, "version": version, "label": label,
                       "merged_adapters": merged, "checksum": checksum}
        return {"success": True, "staged": True, "weight_version": version,
                "weights_checksum": checksum,
                "message": f"staged {len(tensors)} tensors of version {version}; served "
                           f"{self.engine.version} until /update_weights_commit"}

    def commit_staged(self, payload: dict) -> dict:
        """/update_weights_commit {weight_version, commit (default true)}: swap in the staged
        update of that version (commit false: drop it). 409 when none of that version is
        staged: the served weights stay as they are."""
        start = time.monotonic()
        check_flags(payload, ("commit",))
        request_timeout(payload)  # refused while the staged update is still kept
        with self._alone(0.0):
            staged, version = self.staged, payload.get("weight_version")
            if isinstance(version, str) and version.strip().isdecimal():
                version = int(version)  # SGLang's clients send versions as strings
            if staged is None or staged["version"] != version:
                raise UpdateError(f"weight_version: must be the staged update's "
                                  f"({None if staged is None else staged['version']}), got "
                                  f"{version!r}; served weights kept", 409)
            self.staged = None
            if payload.get("commit", True) is False:
                return {"success": True, "weight_version": self.engine.version,
                        "message": f"staged version {version} dropped"}
            self._swap(staged["tensors"], staged["version"], staged["label"], whole=True,
                       merged_adapters=staged["merged_adapters"],
                       timeout_s=http_swap_s(payload, start))
            return {"success": True, "weight_version": staged["version"],
                    "weights_checksum": self.engine.weights_checksum(),
                    "message": f"committed version {staged['version']}"}

    def _commit_loaded(self, tensors: dict, version: int, label, *,
                       merged_adapters: bool = False, swap_s: float = 300.0) -> dict:
        """Swap in a whole update that is already here (IPC, disk) once it is finite; the
        answer's checksum is that of the weights served after the swap."""
        bad = first_non_finite(tensors)
        if bad:
            raise UpdateError(f"update rejected, previous weights kept: tensors must be finite, "
                              f"got NaN/inf in {bad}")
        self._swap(tensors, version, label, whole=True, merged_adapters=merged_adapters,
                   timeout_s=swap_s)
        return {"success": True, "weight_version": version,
                "weights_checksum": self.engine.weights_checksum(),
                "message": f"updated {len(tensors)} tensors to version {version}"}

    def load_lora_adapter(self, payload: dict) -> dict:
        """/load_lora_adapter (SGLang's payload): see fsdpfn.rollout.lora."""
        with self._alone(0.0):
            if self.merged_push is not None:
                raise UpdateError(
                    f"lora_path: this server serves version {self.merged_push}, a LoRA "
                    f"trainer's weights pushed whole with its adapters merged in; an adapter "
                    f"loaded on top would count them twice: load adapters only on a server "
                    f"whose weights are the base model (restart it, or push the base weights), "
                    f"got {payload.get('lora_path')!r}")
            tensors, slot, version = rollout_lora.load_adapter(self.engine, self.adapter,
                                                               payload)
            self.engine.swap(tensors, version)
            self.adapter, self.last_error = slot, None
            return rollout_lora.answer(self.engine, slot, f"adapter {slot.name!r} merged into "
                                       f"{len(slot.base)} weights, version {version}")

    def unload_lora_adapter(self, payload: dict) -> dict:
        """/unload_lora_adapter (SGLang's payload): the base weights served again."""
        with self._alone(0.0):
            tensors, version = rollout_lora.unload_adapter(self.engine, self.adapter, payload)
            name, self.adapter = self.adapter.name, None
            self.engine.swap(tensors, version)
            return rollout_lora.answer(self.engine, None, f"adapter {name!r} unloaded, version "
                                       f"{version}")


def _shut(sock) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
