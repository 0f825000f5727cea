"""Model build time (one GPU): ``shard_model`` of large shapes from random init and from a
safetensors directory, with where the time goes.

    python benchmarks/build.py                               # 7B and 14B, per_layer_bf16
    python benchmarks/build.py --shapes 7B --options default per_layer_bf16
    python benchmarks/build.py --cpu                         # a smoke run (tiny model, CPU)

Each build runs in a fresh process (as a job's trainer does), under cProfile. A row: the shape,
the memory option (benchmarks/memory.py's names), the source (``random``: HF's init drawn piece
by piece on the device; ``safetensors``: a directory this script writes first, in bf16 shards of
about 5 GB, with the time that writing took), shard_model's own phases
(``last_timings(state)["shard_model"]``), the process's time to its first line and to the end,
and the peak device memory. Under each table: the functions with the most time of their own
during the build, which is where a cut has to land.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _table import print_markdown_table  # noqa: E402
from memory import OPTIONS, SHAPES, _engine_config  # noqa: E402 - benchmarks/memory.py

RESULT = "# result "
GiB = 2**30


def write_safetensors(shape: str, path: str, device: str) -> float:
    """A Qwen2 model directory of ``shape`` in bf16 (config.json and ~5 GB shards), random
    values drawn on ``device``; returns the seconds it took."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    began = time.perf_counter()
    spec = {"vocab_size": 151936, "max_position_embeddings": 131072, "rope_theta": 1e6,
            **SHAPES[shape]}
    config = AutoConfig.for_model("qwen2", **spec, dtype="bfloat16")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    tied = getattr(config, "tie_word_embeddings", False)
    os.makedirs(path, exist_ok=True)
    config.save_pretrained(path)
    shard, size, index, where = {}, 0, 0, {}

    def flush():
        nonlocal shard, size, index
        if shard:
            name = f"model-{index:05d}.safetensors"
            save_file(shard, os.path.join(path, name), metadata={"format": "pt"})
            where.update({k: name for k in shard})
            shard, size, index = {}, 0, index + 1

    gen = torch.Generator(device=device).manual_seed(0)
    for key, meta in model.state_dict().items():
        if tied and key == "lm_head.weight":
            continue
        if key.endswith("norm.weight"):
            value = torch.ones(meta.shape, dtype=torch.bfloat16)
        else:
            value = (torch.randn(meta.shape, generator=gen, device=device, dtype=torch.float32)
                     * 0.02).to(torch.bfloat16).cpu()
        shard[key] = value
        size += value.numel() * 2
        if size >= 5 * 10**9:
            flush()
    flush()
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": where}, f)
    return time.perf_counter() - began


def trial(spec: dict) -> None:
    """One build in this process, under cProfile; prints one RESULT line."""
    import attrs
    import torch

    import fsdpfn as ff

    device = "cpu" if spec["cpu"] else "cuda"
    out = dict(shape=spec["shape"], option=spec["option"], source=spec["source"], ok=False,
               start_s=round(time.time() - spec["launched"], 1))  # interpreter and imports
    profile = cProfile.Profile()
    try:
        config = _engine_config(spec["shape"], spec["option"], 4096, 1, 1)
        if spec["source"] == "safetensors":
            config = attrs.evolve(config, model_path=spec["path"], model_config=None)
        mesh = ff.build_mesh(ff.ParallelStrategy(dp=1), device_type=device)
        profile.enable()
        state = ff.shard_model(config, mesh)
        profile.disable()
        build = ff.last_timings(state)["shard_model"]
        out.update(ok=True, build_s=round(build["time_total"], 1),
                   phases={k.removeprefix("time_"): round(v, 1) for k, v in build.items()
                           if k != "time_total"},
                   params_B=round(sum(p.numel() for p in state.model.parameters()) / 1e9, 2))
        if device == "cuda":
            out["peak_GiB"] = round(torch.cuda.max_memory_allocated() / GiB, 1)
    except BaseException as exc:  # noqa: BLE001 - report it, never raise
        profile.disable()
        out["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(spec["top"])
    out["profile"] = _profile_lines(text.getvalue())
    text = io.StringIO()  # the project's own functions by cumulative time
    pstats.Stats(profile, stream=text).sort_stats("cumtime").print_stats("fsdpfn/", spec["top"])
    out["profile_own"] = _profile_lines(text.getvalue())
    out["end_s"] = round(time.time() - spec["launched"], 1)
    print(RESULT + json.dumps(out), flush=True)


def _profile_lines(text: str) -> list[str]:
    """pstats' rows (ncalls tottime percall cumtime percall where), paths shortened."""
    rows, started = [], False
    for line in text.splitlines():
        if line.strip().startswith("ncalls"):
            started = True
            continue
        if started and line.strip():
            parts = line.split(None, 5)
            if len(parts) == 6:
                where = parts[5]
                for cut in ("site-packages/", "fsdpfn/"):
                    if cut in where:
                        where = (cut if cut == "fsdpfn/" else "") + where.split(cut, 1)[1]
                rows.append(f"{parts[1]:>8} s own, {parts[3]:>8} s cum, {parts[0]:>7} calls: "
                            f"{where}")
    return rows


def run_trial(shape, option, source, path, args) -> dict:
    spec = dict(shape=shape, option=option, source=source, path=path, cpu=args.cpu,
                top=args.top, launched=time.time())
    cmd = [sys.executable, os.path.abspath(__file__), "_trial", json.dumps(spec)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        lines = done.stdout.splitlines()
        tail = done.stderr.strip().splitlines()[-1:] if done.returncode else []
    except subprocess.TimeoutExpired:
        lines, tail = [], [f"timed out after {args.timeout:.0f} s"]
    found = [json.loads(x[len(RESULT):]) for x in lines if x.startswith(RESULT)]
    if found:
        return found[-1]
    return dict(shape=shape, option=option, source=source, ok=False,
                error=tail[0][:160] if tail else "no result")


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "_trial":
        trial(json.loads(sys.argv[2]))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="+", default=["7B", "14B"], choices=list(SHAPES))
    p.add_argument("--options", nargs="+", default=["per_layer_bf16"], choices=list(OPTIONS))
    p.add_argument("--sources", nargs="+", default=["random", "safetensors"],
                   choices=["random", "safetensors"])
    p.add_argument("--dir", default="/tmp/fsdpfn_build", help="where the weights are written")
    p.add_argument("--top", type=int, default=12, help="profile rows per build")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per build")
    p.add_argument("--cpu", action="store_true", help="a smoke run: tiny model on CPU")
    args = p.parse_args()
    if args.cpu:
        args.shapes = ["tiny"]
    import torch

    if not args.cpu and not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --cpu for a smoke run)")
    print(f"# {'CPU' if args.cpu else torch.cuda.get_device_name()}, torch {torch.__version__}")
    rows, profiles = [], []
    for shape in args.shapes:
        path, wrote = os.path.join(args.dir, shape), None
        for source in args.sources:
            if source == "safetensors" and wrote is None:
                wrote = write_safetensors(shape, path, "cpu" if args.cpu else "cuda")
            for option in args.options:
                r = run_trial(shape, option, source, path, args)
                phases = sorted(r.get("phases", {}).items(), key=lambda kv: -kv[1])
                rows.append({"shape": shape, "option": option,
                             "source": source + (f" (written in {wrote:.1f} s)"
                                                 if source == "safetensors" else ""),
                             "build s": r.get("build_s", ""),
                             "phases (s)": ", ".join(f"{k} {v}" for k, v in phases),
                             "process start s": r.get("start_s", ""),
                             "process end s": r.get("end_s", ""),
                             "peak GiB": r.get("peak_GiB", ""),
                             "error": r.get("error", "")})
                profiles.append((f"{shape} {option} {source}", r.get("profile", []),
                                 r.get("profile_own", [])))
                print(json.dumps(rows[-1]), flush=True)  # as each lands: a timeout keeps it
                _print_profile(*profiles[-1])
        shutil.rmtree(path, ignore_errors=True)  # 15-30 GB a shape
    print("\n# shard_model per shape, option and source (fresh process each)")
    print_markdown_table(rows, ("shape", "option", "source", "build s", "phases (s)"))


def _print_profile(name: str, lines: list[str], own: list[str]) -> None:
    print(f"\n# {name}: functions with the most time of their own in the build")
    for line in lines:
        print("    " + line)
    print(f"# {name}: fsdpfn's functions by cumulative time")
    for line in own:
        print("    " + line, flush=True)


if __name__ == "__main__":
    main()
