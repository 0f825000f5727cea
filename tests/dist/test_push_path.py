"""How far a push travels: followed from push_weights to the server's swap, the update channel
push passes through at most a dozen functions in at most seven files (the trainer's push, its
gather and its end of the channel; the wire both ends speak; the server's end of the channel,
its receiver and its engine).

A tracer (sys.setprofile, and threading.setprofile for the server's threads) records the fsdpfn
frames on the stack where the bytes leave the trainer (fsdpfn.wire.protocol.broadcast) and where
the served weights change (RolloutEngine.swap). Trainer and server live in one rank process here
(the server's engine, its update channel and its HTTP app in threads), so one tracer sees both
ends of a real push over gloo. Run with -s to print the path.
"""

from __future__ import annotations

import sys
import threading
import time

import pytest

from fsdpfn.testing import save_tiny_model, tiny_qwen2_config

pytestmark = pytest.mark.dist

MAX_FUNCTIONS, MAX_FILES = 12, 7


def _where(frame) -> str | None:
    """'fsdpfn/<file>:<qualname>' of an fsdpfn frame, else None."""
    path = frame.f_code.co_filename.replace("\\", "/")
    if "/fsdpfn/" not in path or "/tests/" in path:
        return None
    return f"fsdpfn/{path.rsplit('/fsdpfn/', 1)[1]}:{frame.f_code.co_qualname}"


def _stack(frame) -> list[str]:
    """The fsdpfn frames on the stack, outermost first, from push_weights on when it is there
    (the rank's harness above it is not the push)."""
    out = []
    while frame is not None:
        where = _where(frame)
        if where is not None:
            out.append(where)
        frame = frame.f_back
    out = out[::-1]
    start = "fsdpfn/weights/push.py:push_weights"
    return out[out.index(start):] if start in out else out


def _serve(model_dir: str):
    """A rollout server in this process: its engine, update channel and HTTP app (threads)."""
    import uvicorn

    from fsdpfn.wire.ports import free_port
    from fsdpfn.rollout import RolloutEngine
    from fsdpfn.rollout.channel import UpdateChannel
    from fsdpfn.rollout.server import build_app

    engine = RolloutEngine(model_dir, dtype="float32", device="cpu")
    channel = UpdateChannel(engine.receiver)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(engine), host="127.0.0.1", port=port,
                                           log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.monotonic() + 60
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    return engine, channel, server, f"http://127.0.0.1:{port}"


def trace_push(model_dir: str):
    """(trainer stack at the first broadcast, server stack at the swap, version served)."""
    import fsdpfn as ff
    from fsdpfn.weights import PushConfig, RolloutTarget, push_weights

    engine, channel, server, url = _serve(model_dir)
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=-1), device_type="cpu")
    state = ff.shard_model(ff.EngineConfig(model_path=model_dir, dtype="float32"), mesh)
    target = RolloutTarget(url, config=PushConfig(timeout_s=30, bucket_bytes=64 * 1024,
                                                  edge_bucket_bytes=None))
    stacks: dict[str, list[str]] = {}

    def tracer(frame, event, arg):
        if event != "call":
            return
        where = _where(frame)
        if where == "fsdpfn/wire/protocol.py:broadcast" and "trainer" not in stacks \
                and threading.current_thread() is threading.main_thread():
            stacks["trainer"] = _stack(frame)
        elif where == "fsdpfn/rollout/engine.py:RolloutEngine.swap":
            stacks["server"] = _stack(frame)

    threading.setprofile(tracer)  # the update channel's connection thread starts in the push
    sys.setprofile(tracer)
    try:
        receipt = push_weights(state, target)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        target.close()
        channel.close()
        server.should_exit = True
    return stacks.get("trainer"), stacks.get("server"), receipt.version, engine.version


@pytest.mark.timeout(240)
def test_a_push_passes_through_at_most_a_dozen_functions_in_seven_files(spmd1, tmp_path):
    model_dir = str(save_tiny_model(tmp_path / "tiny", tiny_qwen2_config(), seed=0))
    trainer, server, pushed, served = spmd1.run(trace_push, args=(model_dir,), timeout=200)[0]
    assert trainer and server and pushed == served  # the push landed, both ends were seen
    assert trainer[0] == "fsdpfn/weights/push.py:push_weights"
    assert server[-1] == "fsdpfn/rollout/engine.py:RolloutEngine.swap"
    path = trainer + server
    files = sorted({p.split(":")[0] for p in path})
    print("\npush path:", *path, f"{len(path)} functions in {len(files)} files", sep="\n  ")
    assert len(path) <= MAX_FUNCTIONS and len(files) <= MAX_FILES, (path, files)
