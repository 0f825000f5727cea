"""The rollout server's command line (``python -m fsdpfn.rollout``): its parser, and the strict
parse with which the launcher (``launch_server``) and the recipes (``rollout.server_args``)
check a command line before any process starts."""

from __future__ import annotations

import argparse


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
# the decode loop's positions a slot when --decode-max-len is not given
DECODE_MAX_LEN = 2048


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
    p.add_argument("--decode-max-len", type=_int_in(2), default=DECODE_MAX_LEN,
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
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8_e4m3"),
                   help="the decode loop's KV cache: in the model's dtype (auto), or float8 "
                        "e4m3 with scale 1 (values saturate at +-448; SGLang's fp8_e4m3): half "
                        "the bytes a position, so twice the rows in the same memory and less "
                        "for the attention to read, at float8's rounding of k and v; the "
                        "returned log-probs are those of the distribution sampled from. Needs "
                        "the Triton attention on a GPU of compute capability 8.9 or later")
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
