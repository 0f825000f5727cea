"""Weight push benchmark (2 GPUs of one host): push_weights over NCCL broadcast against the raw
NCCL broadcast of the same bytes, measured in the same run.

    python benchmarks/push.py                       # Qwen2-1.5B shape, bf16
    python benchmarks/push.py --model 7B --pushes 3

The trainer is this process, a one-rank fsdpfn state on GPU 0 (fp32 master weights, pushed as
bf16). The rollout server is ``python -m fsdpfn.rollout`` on GPU 1. The limit is measured by two
fresh processes on GPU 0 and GPU 1 that broadcast uint8 buffers of exactly the push's bucket
sizes (the default plan's, ramped at both ends, and the whole model as one buffer), over several
rounds. Prints one table: each push variant's best and median seconds, and ``of_limit``, the
median raw broadcast of the default plan's buckets over the median push (the update channel's
share of what NCCL alone does with the same bytes). Finer timing comes from ``--profile``
(torch.profiler on the trainer), not from the product.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import fsdpfn as ff  # noqa: E402
from _table import print_markdown_table  # noqa: E402 - benchmarks/ is this script's folder
from fsdpfn.weights import PushConfig, RolloutTarget, push_weights  # noqa: E402
from fsdpfn.weights.gather import plan_buckets, weight_params  # noqa: E402
from fsdpfn.wire.protocol import DEFAULT_EDGE_BYTES  # noqa: E402

QWEN2_1_5B = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                  num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                  max_position_embeddings=4096, tie_word_embeddings=True)
QWEN2_7B = dict(QWEN2_1_5B, hidden_size=3584, intermediate_size=18944, num_attention_heads=28,
                num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False)
ROWS: list[dict] = []


def record(name: str, **values):
    row = {"name": name, **values}
    ROWS.append(row)
    print(json.dumps(row), flush=True)


def _sync(device: str):
    if device == "cuda":
        torch.cuda.synchronize()


def _raw_rank(rank: int, port: int, sizes: list[int], rounds: int, out: str, device: str):
    import torch.distributed as dist

    if device == "cuda":
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=2, device_id=torch.device("cuda", rank))
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=2)
    results = {}
    for label, layout in (("buckets", sizes), ("one buffer", [sum(sizes)])):
        bufs = [torch.empty(n, dtype=torch.uint8, device=device) for n in layout]
        times = []
        for _ in range(rounds + 2):  # two warm-up rounds
            _sync(device)
            dist.barrier()
            start = time.perf_counter()
            for b in bufs:
                dist.broadcast(b, src=0)
            _sync(device)
            times.append(time.perf_counter() - start)
        results[label] = times[2:]
        del bufs
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def raw_limit(sizes: list[int], device: str, rounds: int = 10) -> dict:
    import torch.multiprocessing as mp

    from fsdpfn.rollout.process import free_port

    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    mp.start_processes(_raw_rank, args=(free_port(), sizes, rounds, out, device), nprocs=2,
                       start_method="spawn")
    with open(out) as f:
        return json.load(f)


def profile_push(state, model_dir, tmp, device, trace):
    from torch.profiler import ProfilerActivity, profile

    from fsdpfn.rollout import launch_server

    server = launch_server(model_dir, device=device, dtype="bfloat16", threads=4, log_dir=tmp,
                           health_timeout=600,
                           env={"CUDA_VISIBLE_DEVICES": "1"} if device == "cuda" else None)
    try:
        target = RolloutTarget(server.url, config=PushConfig(timeout_s=120))
        for _ in range(4):
            push_weights(state, target)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda"
                                               else [])
        with profile(activities=activities, with_stack=True) as prof:
            receipt = push_weights(state, target)
        print(f"profiled push: {receipt.seconds * 1e3:.2f} ms (gather {receipt.gather_s}, "
              f"server apply {receipt.apply_s} s)")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30,
                                        max_name_column_width=60))
        prof.export_chrome_trace(trace)
    finally:
        server.close()


def measure(state, target, pushes: int) -> tuple[float, list]:
    """(the first push's seconds, the receipts of ``pushes`` more, sorted by seconds)."""
    first = push_weights(state, target).seconds
    return first, sorted((push_weights(state, target) for _ in range(pushes)),
                         key=lambda r: r.seconds)


def record_pushes(name: str, first: float, receipts: list, limit: float) -> None:
    best, median = receipts[0], receipts[len(receipts) // 2]
    apply = median.apply_s
    record(name, bytes=best.n_bytes, first_s=round(first, 3), ms=round(best.seconds * 1e3, 2),
           median_ms=round(median.seconds * 1e3, 2),
           gb_s_median=round(best.n_bytes / median.seconds / 1e9, 1),
           of_limit=round(limit / median.seconds, 3),
           apply_ms_median=None if apply is None else round(apply * 1e3, 2))


def sglang_push(state, model_dir: str, limit: float, pushes: int, device: str) -> None:
    """The SGLang protocol (init_weights_update_group, update_weights_from_distributed with
    flattened buckets, pause/continue) against the SGLang stand-in of tests/ in its own process on
    GPU 1: the push's seconds and its share of the raw broadcast limit."""
    import subprocess
    import urllib.request

    from fsdpfn.rollout.process import free_port

    port = free_port()
    here = os.path.dirname(os.path.abspath(__file__))
    cmd = [sys.executable, os.path.join(here, "..", "tests", "sglang_standin.py"), model_dir,
           "--port", str(port), "--device", device,
           "--dtype", "bfloat16" if device == "cuda" else "float32"]
    env = dict(os.environ, **({"CUDA_VISIBLE_DEVICES": "1"} if device == "cuda" else {}))
    proc = subprocess.Popen(cmd, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=5).read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the SGLang stand-in did not start (exit {proc.poll()})")
                time.sleep(1)
        for bucket_bytes in (1 << 30, 256 << 20):
            target = RolloutTarget(url, config=PushConfig(timeout_s=120,
                                                          bucket_bytes=bucket_bytes))
            first, receipts = measure(state, target, pushes)
            record_pushes(f"push, SGLang protocol (stand-in), {bucket_bytes >> 20} MiB buckets",
                          first, receipts, limit)
            target.close()
    finally:
        proc.kill()
        proc.wait()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="1.5B", choices=["1.5B", "7B"])
    parser.add_argument("--pushes", type=int, default=6)
    parser.add_argument("--profile", default=None, metavar="TRACE.json",
                        help="skip the table: profile one warm default push (torch.profiler on "
                             "the trainer), print its top operations, write a Chrome trace")
    parser.add_argument("--quick", action="store_true",
                        help="the limit in 1 GiB buckets only; the first two push variants")
    parser.add_argument("--sglang", action="store_true",
                        help="also push to the SGLang-protocol stand-in of tests/ (GPU 1)")
    parser.add_argument("--cpu", action="store_true",
                        help="a smoke run on CPU (gloo, a tiny model): checks the script only")
    args = parser.parse_args()
    device = "cpu" if args.cpu else "cuda"
    if not args.cpu and torch.cuda.device_count() < 2:
        sys.exit("needs 2 CUDA GPUs: the trainer on GPU 0, the rollout server on GPU 1")
    from transformers import Qwen2Config

    from fsdpfn.rollout import launch_server
    from fsdpfn.testing import save_tiny_model

    tmp = tempfile.mkdtemp(prefix="fsdpfn-push-bench-")
    spec = QWEN2_1_5B if args.model == "1.5B" else QWEN2_7B
    if args.cpu:
        spec = dict(spec, vocab_size=1024, hidden_size=128, intermediate_size=256,
                    num_attention_heads=4)
    cfg = Qwen2Config(**spec)
    model_dir = save_tiny_model(os.path.join(tmp, "model"), cfg, seed=0)
    if not args.cpu:
        torch.cuda.set_device(0)
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=1), device_type=device)
    state = ff.shard_model(ff.EngineConfig(model_path=model_dir, dtype="bfloat16",
                                           optimizer=None), mesh)
    params = weight_params(state)
    n_bytes = sum(p.numel() for _, p in params) * 2
    print(f"# {torch.cuda.get_device_name() if not args.cpu else 'CPU'} "
          f"x{torch.cuda.device_count()}, torch "
          f"{torch.__version__}, Qwen2-{args.model} shape, {len(params)} tensors, "
          f"{n_bytes / 1e9:.2f} GB in bf16", flush=True)

    if args.profile:
        profile_push(state, model_dir, tmp, device, args.profile)
        return
    limits = {}
    for bucket_bytes in (1 << 30,) if args.quick else (1 << 30, 256 << 20):
        sizes = [b.nbytes for b in plan_buckets(params, torch.bfloat16, bucket_bytes,
                                                edge_bytes=DEFAULT_EDGE_BYTES)]
        raw = raw_limit(sizes, device)
        for label, times in raw.items():
            if label == "one buffer" and bucket_bytes != 1 << 30:
                continue
            best = min(times)
            key = f"{bucket_bytes >> 20} MiB" if label == "buckets" else "one buffer"
            limits[key] = statistics.median(times)
            record(f"raw {'NCCL' if device == 'cuda' else 'gloo'} broadcast, {label}"
                   + (f" of {bucket_bytes >> 20} MiB ({len(sizes)})" if label == "buckets"
                      else ""), bytes=n_bytes, ms=round(best * 1e3, 2),
                   median_ms=round(statistics.median(times) * 1e3, 2),
                   gb_s=round(n_bytes / best / 1e9, 1))
    limit = limits["1024 MiB"]  # the median raw broadcast of the default plan's buckets

    server = launch_server(model_dir, device=device, dtype="bfloat16", threads=4,
                           log_dir=tmp, health_timeout=600,
                           env={"CUDA_VISIBLE_DEVICES": "1"} if not args.cpu else None)
    try:
        variants = [
            ("push, defaults (update channel, 1 GiB buckets, 256 MiB at both ends)", {}),
            ("push, update channel, no ramp (edge_bucket_bytes=None)",
             {"edge_bucket_bytes": None}),
            ("push, update channel, ramp from 32 MiB (edge_bucket_bytes=32 MiB)",
             {"edge_bucket_bytes": 32 << 20}),
            ("push, update channel, 256 MiB buckets", {"bucket_bytes": 256 << 20})]
        if args.quick:
            variants = variants[:2]
        for name, kw in variants:
            target = RolloutTarget(server.url, config=PushConfig(timeout_s=120, **kw))
            first, receipts = measure(state, target, args.pushes)
            record_pushes(name, first, receipts, limit)
            target.close()
    finally:
        server.close()
    if args.sglang:
        sglang_push(state, model_dir, limit, args.pushes, device)
    print_markdown_table(ROWS, ("name",))


if __name__ == "__main__":
    main()
