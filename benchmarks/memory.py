"""Memory options benchmark (one GPU): what each option buys and what it costs.

    python benchmarks/memory.py largest                  # largest Qwen2-family shape per option
    python benchmarks/memory.py longest                  # longest sequence of the 7B shape
    python benchmarks/memory.py cost --shape 1.5B        # tokens/s of each option vs the default
    python benchmarks/memory.py all                      # the three, one table each
    python benchmarks/memory.py cost --cpu               # a smoke run (tiny model, CPU)

Options (EngineConfig / FSDPConfig): ``default`` (fp32 master weights and AdamW moments on the
device), ``bf16`` (optimizer_dtype="bfloat16": Kahan AdamW), ``per_layer``
(per_layer_optim_step: moments in pinned host memory, streamed one layer at a time),
``per_layer_bf16``, ``offload`` (offload_params: weights, gradients and the AdamW step on the
host) and ``per_layer_offload`` (weights and moments on the host, the step on the device).
Every model is a random init of a Qwen2.5 shape, bf16 compute, activation checkpointing, one
rank. Each trial runs in a fresh process (an out-of-memory error leaves nothing behind): build
the state, one warm-up SFT step, then ``--steps`` timed steps on ``--rows`` rows of ``--seq``
tokens (``longest``: then the longer lengths in the same process, one timed step each). A trial
that fails reports the stage (build, step) and the error's first line. The optimizer state is
created in the first step, so a first step's peak (``--no-warmup``) leaves it out.

* ``largest``: for each option, the shapes from 0.5B upward until one fails; the table gives the
  largest that trained, its peak device memory and tokens/s.
* ``longest``: the 7B shape, one row per step, sequence lengths doubling from ``--seq`` until
  one fails, for each option, all lengths in one process (one build per option; ``--timeout``
  is for all of them); micro-batches hold the whole row.
* ``cost``: one shape, each option's tokens/s, seconds per step and peak memory, relative to
  ``default``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _table import print_markdown_table  # noqa: E402 - benchmarks/ is this script's folder

GiB = 2**30
SHAPES = {  # Qwen2.5 shapes (vocabulary 151936)
    "0.5B": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "1.5B": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True),
    "3B": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
               num_attention_heads=16, num_key_value_heads=2, tie_word_embeddings=True),
    "7B": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False),
    "14B": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
                num_attention_heads=40, num_key_value_heads=8, tie_word_embeddings=False),
    "32B": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                num_attention_heads=40, num_key_value_heads=8, tie_word_embeddings=False),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
                 vocab_size=1024),
}
OPTIONS = {  # name -> (optimizer_dtype, FSDPConfig fields)
    "default": ("float32", {}),
    "bf16": ("bfloat16", {}),
    "per_layer": ("float32", {"per_layer_optim_step": True}),
    "per_layer_bf16": ("bfloat16", {"per_layer_optim_step": True}),
    "offload": ("float32", {"offload_params": True}),
    "per_layer_offload": ("float32", {"per_layer_optim_step": True, "offload_params": True}),
}


# ---------------------------------------------------------------- one trial (a child process)


def _batch(rows: int, seq: int, vocab: int):
    import torch
    from tensordict import TensorDict

    ids = torch.randint(0, vocab, (rows, seq))
    attn = torch.ones(rows, seq, dtype=torch.bool)
    loss = attn.clone()
    loss[:, 0] = False
    return TensorDict({"input_ids": ids, "attention_mask": attn, "loss_mask": loss},
                      batch_size=[rows])


def _engine_config(shape: str, option: str, seq: int, rows: int, prefetch: int,
                   compile: bool = False):
    import fsdpfn as ff

    optimizer_dtype, fsdp = OPTIONS[option]
    if fsdp.get("per_layer_optim_step"):
        fsdp = {**fsdp, "optim_step_prefetch_layers": prefetch}
    spec = {"model_type": "qwen2", "vocab_size": 151936, "max_position_embeddings": 131072,
            "rope_theta": 1e6, **SHAPES[shape]}
    return ff.EngineConfig(model_config=spec, dtype="bfloat16", optimizer_dtype=optimizer_dtype,
                           gradient_checkpointing=True, fsdp=ff.FSDPConfig(**fsdp),
                           mb_spec=ff.MicroBatchSpec(max_tokens_per_mb=max(seq, 16384)),
                           optimizer=ff.OptimizerConfig(lr=1e-6), compile=compile)


def trial(spec: dict) -> list[dict]:
    """Build one state, then for each length in ``spec["seqs"]`` (increasing) time SFT steps
    of ``spec["rows"]`` rows, until one fails; every failure is reported, never raised. The
    first length gets a warm-up step, the later ones none (their one timed step includes the
    allocator's growth). Each result is printed, and written to the marks file, as it lands."""
    import torch

    import fsdpfn as ff

    device = "cpu" if spec["cpu"] else "cuda"
    began = time.perf_counter()

    def note(line: str) -> None:  # the parent reads these if time runs out
        print(line, flush=True)
        if spec.get("marks"):  # a file too: it outlives a pipe the parent stops reading
            with open(spec["marks"], "a") as f:
                f.write(line + "\n")

    def reach(stage: str, out: dict) -> None:
        out["stage"] = stage
        note(f"# stage {stage} at {time.perf_counter() - began:.1f} s")

    results = []
    seqs = spec["seqs"]
    out = dict(shape=spec["shape"], option=spec["option"], seq=seqs[0], ok=False)
    reach("build", out)
    try:
        config = _engine_config(spec["shape"], spec["option"], max(seqs), spec["rows"],
                                spec["prefetch"], spec.get("compile", False))
        mesh = ff.build_mesh(ff.ParallelStrategy(dp=1), device_type=device)
        state = ff.shard_model(config, mesh)
        build = ff.last_timings(state)["shard_model"]  # random init drawn on the device
        build_s = round(build["time_total"], 1)
        phases = {k.removeprefix("time_"): round(v, 1) for k, v in build.items()
                  if k != "time_total"}
        params_B = round(sum(p.numel() for p in state.model.parameters()) / 1e9, 2)
        vocab = config.model_config["vocab_size"]
        for k, seq in enumerate(seqs):
            out = dict(shape=spec["shape"], option=spec["option"], seq=seq, ok=False,
                       params_B=params_B, build_s=build_s, build_phases=phases)
            batch = _batch(spec["rows"], seq, vocab)
            if k == 0 and spec.get("warmup", True):
                reach(f"warm-up step at {seq}", out)
                state, _ = ff.sft_step(state, batch, ff.SFTConfig())
            reach(f"timed steps at {seq}", out)
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            graphs = _compiled_graphs()
            start = time.perf_counter()
            marks = []
            for _ in range(spec["steps"]):
                state, stats = ff.sft_step(state, batch, ff.SFTConfig())
                if device == "cuda":
                    torch.cuda.synchronize()
                marks.append(time.perf_counter())
            if device == "cuda":
                out["peak_GiB"] = round(torch.cuda.max_memory_allocated() / GiB, 1)
            seconds = (marks[-1] - start) / spec["steps"]
            # each timed step's seconds, and the graphs dynamo compiled during them (a step that
            # recompiles stands out in both)
            out["steps_s"] = [round(b - a, 3) for a, b in zip([start, *marks], marks)]
            out["new_graphs"] = _compiled_graphs() - graphs
            last = ff.last_timings(state).get("sft_step", {})  # the last step's split
            out["split_s"] = {k: round(last[f"time_{k}"], 3)
                              for k in ("forward", "backward", "optimizer") if f"time_{k}" in last}
            out.update(ok=True, stage="done", s_per_step=round(seconds, 3),
                       tokens_per_s=round(spec["rows"] * seq / seconds),
                       loss=round(float(stats["loss"]), 4))
            results.append(out)
            note(RESULT + json.dumps(out))
    except BaseException as exc:  # noqa: BLE001 - out of memory, or anything else: report it
        out["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        results.append(out)
        note(RESULT + json.dumps(out))
    return results


def _compiled_graphs() -> int:
    """The graphs torch.compile has built in this process so far (0 without compile)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


RESULT = "# result "


def _run_trial(spec: dict, timeout: float) -> list[dict]:
    """One state in a fresh process, one result per length reached (the last may be a
    failure). A timeout keeps the lengths that finished and names the stage it stopped in."""
    with tempfile.NamedTemporaryFile("r", suffix=".marks") as marks_file:
        spec = dict(spec, marks=marks_file.name)
        cmd = [sys.executable, os.path.abspath(__file__), "_trial", json.dumps(spec)]
        began = time.perf_counter()
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            lines, stderr, error = done.stdout.splitlines(), done.stderr, None
            if done.returncode:
                error = f"exit {done.returncode}"
        except subprocess.TimeoutExpired as exc:
            partial = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            lines = partial.splitlines()
            stderr = (exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes)
                      else (exc.stderr or ""))
            error = f"timed out after {timeout:.0f} s"
        finally:
            print(f"# trial {spec['option']} seqs {spec['seqs']} shape {spec['shape']}: "
                  f"{time.perf_counter() - began:.1f} s", file=sys.stderr, flush=True)
        lines = list(dict.fromkeys(lines + marks_file.read().splitlines()))  # both, once
    results = [json.loads(line[len(RESULT):]) for line in lines if line.startswith(RESULT)]
    for r in results:
        print(json.dumps(r), file=sys.stderr, flush=True)  # progress
    if error and (not results or results[-1]["ok"]):  # it stopped inside a length
        marks = [line[len("# stage "):] for line in lines if line.startswith("# stage ")]
        tail = stderr.strip().splitlines()
        reached = {r["seq"] for r in results}
        seq = next((s for s in spec["seqs"] if s not in reached), spec["seqs"][-1])
        results.append(dict(shape=spec["shape"], option=spec["option"], seq=seq, ok=False,
                            stage=marks[-1] if marks else "before build (no stage reached)",
                            error=error + (f"; last stderr line: {tail[-1][:120]}"
                                           if tail else "")))
    return results


# ---------------------------------------------------------------- the three measurements


def _spec(args, shape, option, seqs=None, rows=None) -> dict:
    return dict(shape=shape, option=option, seqs=seqs or [args.seq], rows=rows or args.rows,
                steps=args.steps, prefetch=args.prefetch, cpu=args.cpu,
                warmup=not args.no_warmup, compile=args.compile)


def _build_text(result: dict) -> str:
    """The build's seconds and its three longest phases (shard_model's last_timings)."""
    phases = sorted(result.get("build_phases", {}).items(), key=lambda kv: -kv[1])[:3]
    inner = ", ".join(f"{name} {sec}" for name, sec in phases)
    return f"{result.get('build_s', '')}" + (f" ({inner})" if inner else "")


def largest(args) -> None:
    shapes = ["tiny"] if args.cpu else (args.shapes or [s for s in SHAPES if s != "tiny"])
    rows = []
    for option in args.options:
        best, failed = None, None
        for shape in shapes:
            result = _run_trial(_spec(args, shape, option), args.timeout)[-1]
            if not result["ok"]:
                failed = result
                break
            best = result
        rows.append({"option": option,
                     "largest shape": f"{best['shape']} ({best['params_B']} B)" if best else "none",
                     "peak GiB": best.get("peak_GiB", "") if best else "",
                     "tokens/s": best["tokens_per_s"] if best else "",
                     "build s": _build_text(best) if best else "",
                     "next fails": (f"{failed['shape']}: {failed['stage']}: {failed['error']}"
                                    if failed else "(all fit)")})
    print(f"\n# largest shape per option: {args.rows} x {args.seq} tokens per step; build s: "
          f"shard_model with random init drawn on the device")
    print_markdown_table(rows, ("option", "largest shape", "peak GiB", "tokens/s", "build s",
                                "next fails"))


def longest(args) -> None:
    shape = "tiny" if args.cpu else "7B"
    rows = []
    for option in args.options:
        seqs, seq = [], args.seq
        while seq <= args.max_seq:
            seqs.append(seq)
            seq *= 2
        results = _run_trial(_spec(args, shape, option, seqs=seqs, rows=1), args.timeout)
        best = next((r for r in reversed(results) if r["ok"]), None)
        failed = None if results[-1]["ok"] else results[-1]
        rows.append({"option": option, "longest sequence": best["seq"] if best else "none",
                     "peak GiB": best.get("peak_GiB", "") if best else "",
                     "tokens/s": best["tokens_per_s"] if best else "",
                     "next fails": (f"{failed['seq']}: {failed['stage']}: {failed['error']}"
                                    if failed else f"(up to {args.max_seq} fit)")})
    print(f"\n# longest sequence of the {shape} shape per option (one row per step)")
    print_markdown_table(rows, ("option", "longest sequence", "peak GiB", "tokens/s",
                                "next fails"))


def cost(args) -> None:
    shape = "tiny" if args.cpu else args.shape
    results = {o: _run_trial(_spec(args, shape, o), args.timeout)[-1] for o in args.options}
    base = results.get("default")
    rows = []
    for option, r in results.items():
        row = {"option": option, "s/step": r.get("s_per_step", ""),
               "tokens/s": r.get("tokens_per_s", ""), "peak GiB": r.get("peak_GiB", ""),
               **{f"{k} s": v for k, v in r.get("split_s", {}).items()},
               "each step s": " ".join(map(str, r.get("steps_s", []))),
               "graphs compiled in the timed steps": r.get("new_graphs", "")}
        if r["ok"] and base and base["ok"]:
            row["vs default"] = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x"
        if not r["ok"]:
            row["error"] = f"{r['stage']}: {r['error']}"
        rows.append(row)
    print(f"\n# tokens/s per option, {shape} shape, {args.rows} x {args.seq} tokens per step, "
          f"{args.steps} timed steps{', compile=True' if args.compile else ''}")
    print_markdown_table(rows, ("option", "s/step", "tokens/s", "vs default", "peak GiB",
                                "forward s", "backward s", "optimizer s"))


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "_trial":
        trial(json.loads(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=["largest", "longest", "cost", "all"])
    parser.add_argument("--options", nargs="+", default=list(OPTIONS), choices=list(OPTIONS))
    parser.add_argument("--shapes", nargs="+", default=None, choices=list(SHAPES),
                        help="for largest: try only these shapes, in order (default: all)")
    parser.add_argument("--shape", default="1.5B", choices=list(SHAPES), help="for cost")
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--prefetch", type=int, default=1, help="optim_step_prefetch_layers")
    parser.add_argument("--max-seq", type=int, default=131072, help="for longest")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per trial")
    parser.add_argument("--cpu", action="store_true", help="a smoke run: tiny model on CPU")
    parser.add_argument("--compile", action="store_true",
                        help="EngineConfig.compile: regional compilation of the decoder blocks "
                             "(its compile falls in the warm-up step)")
    parser.add_argument("--no-warmup", action="store_true",
                        help="no warm-up step: the first timed step includes CUDA's warm-up")
    args = parser.parse_args()
    if args.cpu:
        args.rows, args.seq, args.max_seq = 2, 64, 128
    import torch

    if not args.cpu and not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --cpu for a smoke run)")
    device = torch.cuda.get_device_name() if not args.cpu else "CPU"
    print(f"# {device}, torch {torch.__version__}")
    for name in (["largest", "longest", "cost"] if args.what == "all" else [args.what]):
        {"largest": largest, "longest": longest, "cost": cost}[name](args)


if __name__ == "__main__":
    main()
