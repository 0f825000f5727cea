"""Start a rollout server: ``python -m fsdpfn.rollout --model DIR --port N``.

Serves the HF model in DIR for generation (token ids in, token ids and log-probs out) and accepts
weight pushes from ``fsdpfn.push_weights(state, RolloutTarget("http://host:N"))``. Listens on
127.0.0.1 unless --host says otherwise. See fsdpfn/rollout/server.py for the endpoints.
"""

from __future__ import annotations

import os

from fsdpfn.rollout.args import _device_problem, parse_args, parser


def main(argv=None) -> None:
    args = parse_args(argv)
    from fsdpfn.rollout.process import missing_server_packages

    lacking = missing_server_packages()
    if lacking is not None:  # one line, before the port or the model is touched
        parser().exit(2, f"python -m fsdpfn.rollout: error: the rollout server {lacking}\n")
    if args.parent_pid is not None:
        from fsdpfn.wire.lifeline import watch_launcher

        watch_launcher("the rollout server", args.parent_pid)
    import socket

    # listening before the model loads: a port in use is one line at once, port 0's choice is
    # known for the line it prints, and /health polls wait in the backlog meanwhile (as with
    # --fd, where the launcher bound the port and handed it over)
    listening = socket.socket(fileno=args.fd) if args.fd is not None else \
        _listen(args.host, args.port)
    try:
        _serve(args, listening)
    finally:  # a refused model directory, or the server's end
        listening.close()


def _serve(args, listening) -> None:
    import torch
    import uvicorn

    from fsdpfn.rollout.engine import RolloutEngine
    from fsdpfn.rollout.server import build_app
    from fsdpfn.wire.lifeline import freeze_long_lived

    problem = None if args.device is None else _device_problem(args.device, torch)
    if problem is not None:  # one line, before the model is waited for or loaded
        parser().exit(2, f"python -m fsdpfn.rollout: error: argument --device: {problem}\n")
    if args.wait_for_model > 0:  # after the imports, which take as long as the trainer's
        _wait_for_model(args.model, args.wait_for_model)
    args.model = _model_dir(args.model)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    from fsdpfn.errors import ConfigError
    from fsdpfn.rollout.errors import UpdateError

    try:
        engine = RolloutEngine(args.model, dtype=args.dtype, device=device,
                               load_format=args.load_format,
                               weight_version=args.weight_version, max_pause_s=args.max_pause_s,
                               decode=args.decode, decode_rows=args.decode_rows,
                               decode_max_len=args.decode_max_len,
                               cuda_graphs=not args.no_cuda_graphs,
                               fused_kernels=args.fused_kernels,
                               decode_attention=args.decode_attention,
                               decode_compile=args.decode_compile,
                               decode_rope_kv=args.decode_rope_kv,
                               decode_share_prefix=args.decode_share_prefix,
                               kv_cache_dtype=args.kv_cache_dtype)
    except (ConfigError, UpdateError) as exc:  # a model or option the server refuses: one line
        parser().exit(2, f"python -m fsdpfn.rollout: error: {exc}\n")
    if not args.no_channel:
        from fsdpfn.rollout.channel import UpdateChannel

        UpdateChannel(engine.receiver, args.host, args.channel_port)
    dummy = ", placeholder weights until the first push" if args.load_format == "dummy" else ""
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"fsdpfn.rollout: serving {args.model} ({engine.dtype}, {device}{dummy}) on "
          f"http://{host}:{listening.getsockname()[1]} (update channel: "
          f"{engine.receiver.channel_port}) pid {os.getpid()}", flush=True)
    app = build_app(engine)
    freeze_long_lived()  # the model, the engine, the app: alive until the server ends
    uvicorn.Server(uvicorn.Config(app, log_level=args.log_level)).run(
        sockets=[listening])


def _listen(host: str, port: int):
    """A socket bound to host:port and listening, or one line naming them and why not."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise SystemExit(f"fsdpfn.rollout: --host {host} --port {port}: cannot listen there "
                         f"({exc.strerror or exc})") from None
    return sock


def _model_dir(model: str) -> str:
    """The model directory --model names: itself, or a Hugging Face hub id's snapshot in the
    Hugging Face cache (fetched where the cache lacks it: fsdpfn.wire.hub). One line for one
    that is neither (transformers would read a missing path as a hub id, and the start would
    end in a download's traceback)."""
    from pathlib import Path

    from fsdpfn.wire.hub import HubError, looks_like_hub_id, model_snapshot

    path = Path(model).expanduser()
    if not path.is_dir() and looks_like_hub_id(model):
        try:
            path = Path(model_snapshot(model))
        except HubError as exc:
            raise SystemExit(f"fsdpfn.rollout: --model {model}: must be a model directory "
                             f"(save_pretrained's layout) or a Hugging Face hub model id; "
                             f"{exc}") from None
        print(f"fsdpfn.rollout: --model {model} is the Hugging Face hub model in {path}",
              flush=True)
    if not path.is_dir():
        raise SystemExit(f"fsdpfn.rollout: --model {model}: must be a model directory "
                         f"(save_pretrained's layout), and there is no directory there")
    if not (path / "config.json").is_file():
        raise SystemExit(f"fsdpfn.rollout: --model {model}: must be a model directory "
                         f"(save_pretrained's layout), and it has no config.json")
    return str(path) if path != Path(model).expanduser() else model


def _wait_for_model(model: str, timeout_s: float) -> None:
    from pathlib import Path

    from fsdpfn.rollout.process import wait_for_model_dir

    if (Path(model) / "config.json").is_file():
        return
    print(f"fsdpfn.rollout: waiting up to {timeout_s:g} s for {Path(model) / 'config.json'}",
          flush=True)
    if not wait_for_model_dir(model, timeout_s):
        raise SystemExit(f"fsdpfn.rollout: --model {model}: no config.json after "
                         f"{timeout_s:g} s (--wait-for-model)")


if __name__ == "__main__":
    main()
