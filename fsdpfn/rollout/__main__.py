"""Start a rollout server: ``python -m fsdpfn.rollout --model DIR --port N``.

Serves the HF model in DIR for generation (token ids in, token ids and log-probs out) and accepts
weight pushes from ``fsdpfn.push_weights(state, RolloutTarget("http://host:N"))``. Listens on
127.0.0.1 unless --host says otherwise. See fsdpfn/rollout/server.py for the endpoints.
"""

from __future__ import annotations

import argparse
import os


def _int_in(low: int, high: int | None = None):
    """An argparse type: an int in [low, high] (no upper bound: None)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            rule = f"in [{low}, {high}]" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"must be an int {rule}, got {text!r}")
        return value
    return parse


def _seconds(positive: bool):
    """An argparse type: a finite number of seconds, > 0 (``positive``) or >= 0."""
    def parse(text: str) -> float:
        import math

        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < 0 or (positive and value == 0):
            raise argparse.ArgumentTypeError(f"must be a finite number of seconds "
                                             f"{'> 0' if positive else '>= 0'}, got {text!r}")
        return value
    return parse


def _device(text: str) -> str:
    """--device: cpu, cuda or cuda:N, by its form (whether this host has that GPU is checked once
    torch is imported: fsdpfn run checks rollout.server_args with this parser, without torch)."""
    import re

    if not re.fullmatch(r"cpu|cuda(:[0-9]+)?", text):
        raise argparse.ArgumentTypeError(f"must be cpu, cuda or cuda:N, got {text!r}")
    return text


def _device_problem(device: str, torch) -> str | None:
    """Why this host cannot serve on ``device`` (a valid --device), or None."""
    if device == "cpu":
        return None
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n == 0:
        return f"needs a GPU and this host has none (torch.cuda.is_available() is False), " \
               f"got {device!r}"
    index = int(device.partition(":")[2] or 0)
    if index >= n:
        return f"this host has {n} GPU(s) (cuda:0 to cuda:{n - 1}), got {device!r}"
    return None


PORT = _int_in(0, 65535)
# --weight-version counts weight changes (-1 marks tokens no weights sampled, in episode.py)
VERSION = _int_in(0)


def parser(allow_abbrev: bool = True) -> argparse.ArgumentParser:
    """The server's command line (fsdpfn run checks a recipe's rollout.server_args with it)."""
    p = argparse.ArgumentParser(prog="python -m fsdpfn.rollout", allow_abbrev=allow_abbrev,
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="HF model directory (safetensors)")
    p.add_argument("--port", type=PORT, required=True, help="0: a free port (printed)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--fd", type=_int_in(0), default=None,
                   help="serve on this inherited listening socket (bound to --host:--port by the "
                        "process that started the server, so no other process can take the port "
                        "while the model loads) instead of binding the port itself")
    p.add_argument("--dtype", default="auto", type=lambda text: text.removeprefix("torch."),
                   choices=("auto", "bfloat16", "float16", "float32", "float64"),
                   help="the served weights' dtype (auto: config.json's, else float32)")
    p.add_argument("--load-format", default="auto", choices=("auto", "dummy"),
                   help="auto: the directory's weights; dummy: placeholder weights of its "
                        "config.json (SGLang's name), for a trainer that pushes its own before "
                        "asking for anything")
    p.add_argument("--wait-for-model", type=_seconds(False), default=0.0, metavar="SECONDS",
                   help="wait up to this many seconds for --model's config.json to appear (a "
                        "trainer that writes the starting model as it starts, as fsdpfn run's "
                        "rank 0 writes the embedded model; default 0: it must be there)")
    p.add_argument("--device", type=_device, default=None,
                   help="cpu | cuda | cuda:N (default: cuda if any)")
    p.add_argument("--weight-version", type=VERSION, default=0,
                   help="version of the initial weights (an int >= 0)")
    p.add_argument("--max-pause-s", type=_seconds(True), default=600.0,
                   help="a /pause_generation expires by itself after this many seconds")
    p.add_argument("--threads", type=_threads, default=None,
                   help="torch CPU threads, at most this host's cores")
    p.add_argument("--channel-port", type=PORT, default=0,
                   help="port of the update channel, the fast control path of weight pushes "
                        "(default 0: a free port, advertised in /get_model_info)")
    p.add_argument("--no-channel", action="store_true",
                   help="no update channel: trainers then push in SGLang's protocol")
    p.add_argument("--decode", default="auto", choices=("auto", "hf", "loop"),
                   help="generation: 'loop' is the decode loop (slot KV cache, continuous "
                        "batching, CUDA graphs), 'hf' is HF generate; auto: loop on CUDA, hf on "
                        "CPU")
    p.add_argument("--decode-rows", type=_int_in(1), default=None,
                   help="rows decoded at once (KV cache slots; default: half the free GPU "
                        "memory, at most 1024)")
    p.add_argument("--decode-max-len", type=_int_in(2), default=2048,
                   help="prompt plus new tokens of a row, at most (KV cache positions per slot)")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="decode loop without CUDA graphs (eager steps)")
    p.add_argument("--decode-attention", default="auto",
                   choices=("auto", "flash", "triton", "sdpa", "flex", "matmul"),
                   help="the decode loop's attention: flash attention over each row's own "
                        "length (torch's flash forward with seqused_k; CUDA, bf16/fp16), "
                        "fsdpfn's split-KV Triton kernel over each row's own length, SDPA "
                        "with a mask over the length bucket, FlexAttention (compiled once; a "
                        "split-KV decoding kernel), or two batched matmuls over the cache (fp32 "
                        "scores and softmax); auto: triton where it runs (CUDA with Triton, bf16/fp16), "
                        "else flash where it runs, else sdpa")
    p.add_argument("--decode-compile", action="store_true",
                   help="run the decode loop's step through torch.compile (dynamic shapes, "
                        "compiled once on first use; inductor fuses the elementwise work)")
    p.add_argument("--decode-rope-kv", default="auto", choices=("auto", "torch", "triton"),
                   help="the decode step's rotary of q and k, q's layout and the KV cache "
                        "writes: one Triton kernel a layer (triton; CUDA, bf16/fp16, no q/k "
                        "norms), torch's seven kernels (torch), or triton where it runs (auto, "
                        "the default); the same bits either way")
    p.add_argument("--decode-share-prefix", action=argparse.BooleanOptionalAction, default=True,
                   help="with the Triton attention, the samples of one prompt read the prompt's "
                        "KV from the first sample's cache, so it leaves HBM about once per step "
                        "for all of them instead of once each (default on; the same bits read in "
                        "the same order; --no-decode-share-prefix reads each row's own copy)")
    p.add_argument("--fused-kernels", action=argparse.BooleanOptionalAction, default=True,
                   help="Liger-Kernel's fused RMSNorm and SwiGLU MLP on CUDA (the trainer's "
                        "default kernels), when liger_kernel is installed: fewer kernel launches "
                        "and passes over the activations per decode step (BENCHMARKS.md, "
                        "'Decode step per kernel'; default on; a no-op on CPU)")
    p.add_argument("--log-level", default="warning", type=str.lower,
                   choices=("critical", "error", "warning", "info", "debug", "trace"),
                   help="the HTTP server's (uvicorn's) log level")
    p.add_argument("--parent-pid", type=_int_in(1), default=None,
                   help="exit when the process with this pid exits (the launcher that started "
                        "this server; default: run until stopped)")
    return p


def _threads(text: str) -> int:
    """--threads: an int in [1, this host's cores] (more only slow the server down)."""
    import os

    cores = os.cpu_count() or 1
    try:
        n = int(text)
    except ValueError:
        n = None
    if n is None or not 1 <= n <= cores:
        raise argparse.ArgumentTypeError(f"must be an int in [1, {cores}] (this host's CPU "
                                         f"cores), got {text!r}")
    return n


def parse_args(argv=None) -> argparse.Namespace:
    return parser().parse_args(argv)


def parse_strict(argv: list[str], error=None) -> argparse.Namespace:
    """``argv`` through the server's parser with every flag written out in full (no
    abbreviations); ``error`` is called with argparse's message instead of exiting, a bad
    value's ArgumentError included. What launch_server and rollout.server_args check with."""
    check = parser(allow_abbrev=False)
    if error is None:
        return check.parse_args(argv)
    check.error = error
    try:
        return check.parse_args(argv)
    except argparse.ArgumentError as exc:
        error(str(exc))
        raise


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

    problem = None if args.device is None else _device_problem(args.device, torch)
    if problem is not None:  # one line, before the model is waited for or loaded
        parser().exit(2, f"python -m fsdpfn.rollout: error: argument --device: {problem}\n")
    if args.wait_for_model > 0:  # after the imports, which take as long as the trainer's
        _wait_for_model(args.model, args.wait_for_model)
    args.model = _model_dir(args.model)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
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
                           decode_share_prefix=args.decode_share_prefix)
    if not args.no_channel:
        from fsdpfn.rollout.channel import UpdateChannel

        UpdateChannel(engine.receiver, args.host, args.channel_port)
    dummy = ", placeholder weights until the first push" if args.load_format == "dummy" else ""
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"fsdpfn.rollout: serving {args.model} ({engine.dtype}, {device}{dummy}) on "
          f"http://{host}:{listening.getsockname()[1]} (update channel: "
          f"{engine.receiver.channel_port}) pid {os.getpid()}", flush=True)
    uvicorn.Server(uvicorn.Config(build_app(engine), log_level=args.log_level)).run(
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
