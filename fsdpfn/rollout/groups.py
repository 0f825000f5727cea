"""The server's weights-update groups and the turn-taking of updates (fsdpfn.rollout.updates).

A group is a stateless process group built from the trainer's TCPStore (fsdpfn.wire.protocol);
update channel connections bound to a group are closed when it is dropped, so the trainer learns
it must set up again. ``exclusive``/``wait_turn`` order updates, group changes and the buckets of
one update (bucket_index == the next expected bucket of its update_id), 409 after a wait.
"""

from __future__ import annotations

import contextlib
import time

from fsdpfn.rollout.errors import UpdateError
from fsdpfn.wire.protocol import make_group

__all__ = ["init_group", "destroy_group", "retire_group", "attach_channel", "detach_channel",
           "exclusive", "wait_turn", "fail_update", "require_group"]


def init_group(engine, payload: dict) -> dict:
    """/init_weights_update_group: {master_address, master_port, rank_offset, world_size,
    group_name, backend, timeout_s (ours, default 300)}; blocks until every member joined."""
    try:
        name = str(payload["group_name"])
        backend = str(payload.get("backend") or "gloo")
        args = dict(master_address=str(payload["master_address"]),
                    master_port=int(payload["master_port"]),
                    rank=int(payload["rank_offset"]), world_size=int(payload["world_size"]),
                    group_name=name, backend=backend,
                    timeout_s=float(payload.get("timeout_s") or 300.0))
    except (KeyError, TypeError, ValueError) as exc:
        raise UpdateError(f"init_weights_update_group: payload must hold master_address, "
                          f"master_port, rank_offset, world_size, group_name; got "
                          f"{sorted(payload)} ({type(exc).__name__}: {exc})") from None
    if backend == "nccl" and engine.device.type != "cuda":
        raise UpdateError(f"backend: 'nccl' needs a server on cuda, this one serves on "
                          f"{engine.device}")
    with exclusive(engine, args["timeout_s"]):
        retire_group(engine, name)
        try:
            group = make_group(device=engine.device, **args)
        except Exception as exc:  # noqa: BLE001 - rendezvous failures come in many types
            raise UpdateError(f"init_weights_update_group {name!r}: joining "
                              f"{args['master_address']}:{args['master_port']} as rank "
                              f"{args['rank']} of {args['world_size']} failed: "
                              f"{type(exc).__name__}: {exc}", 500) from None
        engine._groups[name] = (*group, backend, args["timeout_s"])
    return {"success": True, "message": f"joined group {name!r}"}


def destroy_group(engine, name: str) -> dict:
    with exclusive(engine, 60.0):
        retire_group(engine, name)
    return {"success": True}


def retire_group(engine, name: str) -> None:
    group = engine._groups.pop(name, None)
    if group is not None:
        engine._retired.append(group)
    with engine._channels_lock:
        sockets = engine._channels.pop(name, [])
    for sock in sockets:  # the trainer learns the group is gone from the closed connection
        shut(sock)


def attach_channel(engine, group_name: str, sock) -> None:
    """Bind an update channel connection to a group: it is closed when the group is
    dropped."""
    with engine._channels_lock:
        if group_name not in engine._groups:
            raise UpdateError(f"group_name: no weights-update group {group_name!r} on this "
                              f"server (groups: {engine.group_names})", 404)
        engine._channels.setdefault(group_name, []).append(sock)


def detach_channel(engine, sock) -> None:
    with engine._channels_lock:
        for sockets in engine._channels.values():
            if sock in sockets:
                sockets.remove(sock)


@contextlib.contextmanager
def exclusive(engine, wait_s: float):
    """No other update, group change or bucket runs meanwhile (409 after ``wait_s``)."""
    wait_turn(engine, None, 0, wait_s)
    try:
        yield
    finally:
        with engine._turn:
            engine._busy = False
            engine._turn.notify_all()


def wait_turn(engine, update_id, index: int, wait_s: float) -> None:
    """Block until no update runs and, for bucket ``index`` > 0 of ``update_id``, until the
    buckets before it are done (or the update failed, or was replaced); 409 after
    ``wait_s``."""
    deadline = time.monotonic() + wait_s
    with engine._turn:
        while True:
            st = engine._staging
            ready = (update_id is None or index == 0 or update_id in engine._failed
                     or st is None or st.update_id != update_id or st.next_bucket >= index)
            if not engine._busy and ready:
                engine._busy = True
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise UpdateError("update_weights_from_distributed: another update is in "
                                  "progress", 409)
            engine._turn.wait(remaining)


def fail_update(engine, exc: UpdateError) -> None:
    engine._staging = None
    engine.last_error = str(exc)
    engine.resume()  # a failed update never leaves generation paused


def require_group(engine, group_name: str) -> None:
    if group_name not in engine._groups:
        raise UpdateError(f"group_name: no weights-update group {group_name!r} on this "
                          f"server (groups: {engine.group_names}); call "
                          f"/init_weights_update_group first", 404)


def shut(sock) -> None:
    import socket

    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
