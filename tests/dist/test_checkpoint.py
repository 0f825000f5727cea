"""save_checkpoint / load_checkpoint / export_hf on CPU ranks (gloo).

What is shown, each against a simple reference:

* exact resume: 4 SFT steps straight equal 2 steps, save, a FRESH process group loads, 2 more
  steps (parameters, Adam moments, losses, LR schedule, RNG draws; bit-exact in float32);
* resharding dp=2 -> dp=1 -> dp=2 x tp=2 -> dp=2 keeps parameters and optimizer state exactly
  (full state dicts gathered to rank 0, AdamW exp_avg / exp_avg_sq / step included);
* a save killed with SIGKILL mid-write leaves the previous checkpoints loadable and nothing that
  looks complete but is not; the next save cleans the leftovers up;
* export_hf loads with transformers and reproduces forward_logp / compute_values;
* every CheckpointError case leaves the state unchanged and live on every rank;
* async_save stages a copy (the next steps do not leak into it) and keep_last rotates.

Ranks return verdicts instead of asserting, so no rank is left waiting in a collective.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict)

import fsdpfn as ff
from fsdpfn.checkpoint import (MANIFEST, MARKER, export_hf, latest_checkpoint, load_checkpoint,
                               save_checkpoint)
from fsdpfn.errors import CheckpointError, StaleStateError
from fsdpfn.testing import run_spmd, save_tiny_model, tiny_qwen2_config

pytestmark = pytest.mark.dist

OPT = ff.OptimizerConfig(lr=1e-2, schedule="cosine", warmup_steps=2, total_steps=6,
                         weight_decay=0.1)


# ---------------------------------------------------------------- helpers run on every rank


def _cfg(*, seed=1, optimizer=OPT, fsdp=None, **model):
    return ff.EngineConfig(model_config=tiny_qwen2_config(**model).to_dict(), dtype="float32",
                           optimizer=optimizer, seed=seed, fsdp=fsdp or ff.FSDPConfig())


def _state(dp=-1, tp=1, **cfg):
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=dp, tp=tp), device_type="cpu")
    return ff.shard_model(_cfg(**cfg), mesh)


def _batch(B=6, T=12, V=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(4, T + 1, (B,), generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    attn = torch.arange(T)[None] < lens[:, None]
    loss = attn.clone()
    loss[:, :2] = False
    return TensorDict({"input_ids": ids, "attention_mask": attn, "loss_mask": loss},
                      batch_size=[B])


def _steps(state, n):
    losses = []
    for i in range(n):
        state, stats = ff.sft_step(state, _batch(seed=i % 2), ff.SFTConfig())
        losses.append(float(stats["loss"]))
    return state, losses


def _full(state) -> dict | None:
    """Full model and optimizer state, gathered to rank 0 (None elsewhere), flat keys."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    out = {f"model/{k}": v for k, v in get_model_state_dict(state.model, options=opts).items()}
    if state.optimizer is not None:
        osd = get_optimizer_state_dict(state.model, state.optimizer, options=opts)
        for fqn, entry in osd.get("state", {}).items():
            out.update({f"optim/{fqn}/{k}": v for k, v in entry.items()})
        for group in osd.get("param_groups", []):
            out.update({f"group/{p}/lr": torch.tensor(group["lr"], dtype=torch.float64)
                        for p in group["params"]})
        out["scheduler"] = torch.tensor(state.scheduler.last_epoch)
    # clone: scalars such as Adam's step come back as the live tensors, which later steps bump
    return {k: v.clone() for k, v in out.items()} if dist.get_rank() == 0 else None


def _local(state) -> dict:
    """This rank's shards of everything a failed call must leave alone."""
    snap = {f"p/{n}": p.to_local().detach().clone() for n, p in state.model.named_parameters()}
    if state.optimizer is not None:
        for i, s in enumerate(state.optimizer.state.values()):
            snap.update({f"o/{i}/{k}": (v.to_local() if hasattr(v, "to_local") else v).clone()
                         for k, v in s.items()})
        snap["sched"] = json.dumps(state.scheduler.state_dict(), sort_keys=True)
    snap["meta"] = (state.step, state.version, state.is_live)
    return snap


def _same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    return all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k]
               for k in a)


def _draws():
    return torch.rand(4), random.random()


# ---------------------------------------------------------------- exact resume


def _train_save_continue(root):
    state, losses = _steps(_state(), 2)
    torch.manual_seed(1234 + dist.get_rank())
    random.seed(99)
    save_checkpoint(state, Path(root) / "step_2", extra={"data_pos": 12, "epoch": [0, 1]})
    draws = _draws()
    full2 = _full(state)
    state, more = _steps(state, 2)
    return dict(losses=losses + more, draws=draws, full2=full2, full4=_full(state),
                step=state.step, version=state.version)


def _resume(root):
    state = _state(seed=7)  # different initial weights: the load must replace them all
    state, extra = load_checkpoint(state, Path(root) / "step_2")
    draws = _draws()
    meta = (state.step, state.version, state.scheduler.last_epoch)
    state, losses = _steps(state, 2)
    return dict(extra=extra, draws=draws, meta=meta, losses=losses, full4=_full(state))


def _assert_equal_full(a: dict, b: dict, what: str):
    assert a.keys() == b.keys(), f"{what}: keys differ: {sorted(a.keys() ^ b.keys())[:5]}"
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    assert not bad, f"{what}: {len(bad)} of {len(a)} entries differ, e.g. {bad[:4]}"


@pytest.fixture(scope="module")
def base(spmd2, tmp_path_factory):
    """Two SFT steps at dp=2, saved to <root>/step_2, then two more steps (the straight run)."""
    root = tmp_path_factory.mktemp("base")
    results = spmd2.run(_train_save_continue, args=(str(root),), timeout=120)
    return root, results


@pytest.mark.timeout(240)
def test_exact_resume_in_a_fresh_process_group(base):
    root, straight = base
    resumed = run_spmd(_resume, 2, args=(str(root),), timeout=120)  # new processes, new group
    for rank in range(2):
        assert resumed[rank]["extra"] == {"data_pos": 12, "epoch": [0, 1]}
        s_t, s_r = straight[rank]["draws"], resumed[rank]["draws"]
        assert torch.equal(s_t[0], s_r[0]) and s_t[1] == s_r[1], "RNG not restored"
        # saved step 2, version max(0, 2) + 1, scheduler at step 2
        assert resumed[rank]["meta"] == (2, 3, 2)
        assert resumed[rank]["losses"] == straight[rank]["losses"][2:]  # bit-exact floats
    _assert_equal_full(straight[0]["full4"], resumed[0]["full4"], "after 4 steps")
    assert any(k.endswith("exp_avg_sq") for k in straight[0]["full4"])


# ---------------------------------------------------------------- resharding


def _load_then_save(src, dst, dp, tp):
    from transformers import AutoModelForCausalLM

    state = _state(dp=dp, tp=tp, seed=5)
    state, extra = load_checkpoint(state, src)
    full = _full(state)
    save_checkpoint(state, dst, extra=extra)
    export_err = None
    if tp > 1:  # export gathers 2-D (FSDP x TP) shards
        export_hf(state, f"{dst}_hf", dtype="float32")
        logp = ff.forward_logp(state, _batch())["logp"]
        if dist.get_rank() == 0:
            model = AutoModelForCausalLM.from_pretrained(f"{dst}_hf", dtype=torch.float32)
            export_err = float((_hf_logp(model, _batch()) - logp).abs().max())
    return full, state.step, extra, export_err


@pytest.mark.timeout(240)
def test_reshard_round_trip_dp2_dp1_dp2xtp2_dp2(base, spmd1, spmd2, spmd4, tmp_path):
    root, straight = base
    reference = straight[0]["full2"]
    chain = [(spmd1, 1, 1), (spmd4, 2, 2), (spmd2, 2, 1)]
    src = root / "step_2"
    for index, (pool, dp, tp) in enumerate(chain):
        dst = tmp_path / f"hop_{index}"
        results = pool.run(_load_then_save, args=(str(src), str(dst), dp, tp), timeout=120)
        full, step, extra, export_err = results[0]
        assert step == 2 and extra["data_pos"] == 12
        if tp > 1:
            assert export_err is not None and export_err < 1e-5, export_err
        _assert_equal_full(reference, full, f"loaded at dp={dp} tp={tp}")
        manifest = json.loads((dst / MANIFEST).read_text())
        assert manifest["mesh"]["world_size"] == pool.world_size
        src = dst


# ---------------------------------------------------------------- killed mid-write

_CHILD = r"""
import datetime, os, sys, torch, torch.distributed as dist
import fsdpfn as ff
from fsdpfn.checkpoint import save_checkpoint
from fsdpfn.testing import tiny_qwen2_config
root, port = sys.argv[1], int(sys.argv[2])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=60))
mesh = ff.build_mesh(ff.ParallelStrategy(dp=1), device_type="cpu")
cfg = ff.EngineConfig(model_config=tiny_qwen2_config(**BIG).to_dict(), dtype="float32",
                      optimizer=ff.OptimizerConfig(lr=1e-3))
state = ff.shard_model(cfg, mesh)
save_checkpoint(state, os.path.join(root, "step_1"), extra={"i": -1})
for i in range(10**6):
    save_checkpoint(state, os.path.join(root, "step_2"), extra={"i": i})
    if i == 0:
        print("ready", flush=True)
"""
BIG = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4, vocab_size=4096,
           num_attention_heads=4, num_key_value_heads=2)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tmp_with_data(root: Path):
    for entry in root.iterdir():
        try:
            if ".tmp-" in entry.name and any(p.suffix == ".distcp" for p in entry.iterdir()):
                return entry
        except FileNotFoundError:  # published (renamed) meanwhile
            pass
    return None


def _load_big(path):
    state = _state(optimizer=ff.OptimizerConfig(lr=1e-3), **BIG)
    state, extra = load_checkpoint(state, path)
    return extra


def _save_big_rotating(root):
    state = _state(optimizer=ff.OptimizerConfig(lr=1e-3), **BIG)
    save_checkpoint(state, Path(root) / "step_3", keep_last=2)
    return sorted(p.name for p in Path(root).iterdir())


@pytest.mark.timeout(420)
def test_save_killed_mid_write_leaves_previous_checkpoint(spmd1, tmp_path):
    root = tmp_path / "run"
    root.mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    child = subprocess.Popen([sys.executable, "-c", f"BIG = {BIG!r}\n" + _CHILD, str(root),
                              str(_free_port())], stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert child.stdout.readline().strip() == "ready", "child failed before its first saves"
        deadline = time.monotonic() + 60
        while (partial := _tmp_with_data(root)) is None and time.monotonic() < deadline:
            time.sleep(0.001)
        os.kill(child.pid, signal.SIGKILL)  # mid-write: the shards are being written
    finally:
        child.kill()
        child.wait()
    assert partial is not None, "the child never started a second save"
    names = sorted(p.name for p in root.iterdir())
    # only the two published checkpoints carry the marker; the partial save does not
    complete = sorted(p.name for p in root.iterdir() if (p / MARKER).exists())
    assert complete == ["step_1", "step_2"], names
    assert all(n in ("step_1", "step_2") or ".tmp-" in n or ".old-" in n for n in names), names
    assert spmd1.run(_load_big, args=(str(root / "step_1"),), timeout=120)[0] == {"i": -1}
    extra = spmd1.run(_load_big, args=(str(root / "step_2"),), timeout=120)[0]
    assert isinstance(extra["i"], int) and extra["i"] >= 0
    if partial.exists():  # (unless a stalled test process let that save finish)
        from fsdpfn.checkpoint import _resolve  # the rule, without a process group

        assert not (partial / MARKER).exists()
        with pytest.raises(CheckpointError, match="without COMPLETE"):
            _resolve(partial)
    assert latest_checkpoint(root).name in ("step_1", "step_2")
    # the next save cleans up the dead process's leftovers and rotates to the last 2
    assert spmd1.run(_save_big_rotating, args=(str(root),), timeout=120)[0] == ["step_2",
                                                                                "step_3"]


# ---------------------------------------------------------------- export_hf


def _hf_logp(model, batch):
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"],
                       attention_mask=batch["attention_mask"].long()).logits.float()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
    mask = batch["attention_mask"][:, 1:]
    return torch.cat([torch.zeros_like(logp[:, :1]), logp * mask], 1)


def _export_cases(root):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    root = Path(root)
    batch = _batch()
    out = {}
    # 1) an actor after one step at dp=2, float32, small shards: index + several files
    state, _ = _steps(_state(), 1)
    export_hf(state, root / "actor", dtype="float32", max_shard_size=64 * 1024)
    logp = ff.forward_logp(state, batch)["logp"]
    if dist.get_rank() == 0:
        model, info = AutoModelForCausalLM.from_pretrained(root / "actor", dtype=torch.float32,
                                                           output_loading_info=True)
        out["actor_err"] = float((_hf_logp(model, batch) - logp).abs().max())
        out["actor_info"] = {k: list(v) for k, v in info.items() if v}
        out["actor_files"] = sorted(p.name for p in (root / "actor").iterdir())
    # 2) tied embeddings from a model directory with tokenizer files, default dtype = bf16
    src = root / "src"
    if dist.get_rank() == 0:
        save_tiny_model(src, tiny_qwen2_config(tie_word_embeddings=True))
        (src / "tokenizer.json").write_text('{"fake": "tokenizer"}')
        (src / "tokenizer_config.json").write_text('{"model_max_length": 512}')
    dist.barrier()
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=-1), device_type="cpu")
    tied = ff.shard_model(ff.EngineConfig(model_path=str(src), dtype="float32",
                                          optimizer=None), mesh)
    export_hf(tied, root / "tied", dtype="bfloat16")
    export_hf(tied, root / "tied_fp32")  # config.dtype: float32
    tied_logp = ff.forward_logp(tied, batch)["logp"]
    if dist.get_rank() == 0:
        with safe_open(root / "tied" / "model.safetensors", "pt") as f:
            out["tied_keys"] = sorted(f.keys())
            out["tied_dtype"] = f.get_tensor("model.embed_tokens.weight").dtype
        out["tied_config_dtype"] = json.loads((root / "tied" / "config.json").read_text())["dtype"]
        out["tied_tok"] = (root / "tied" / "tokenizer.json").read_text()
        out["tied_files"] = sorted(p.name for p in (root / "tied").iterdir())
        model = AutoModelForCausalLM.from_pretrained(root / "tied_fp32", dtype=torch.float32)
        out["tied_err"] = float((_hf_logp(model, batch) - tied_logp).abs().max())
    # 3) a critic: HF token-classification layout, num_labels=1
    critic = ff.shard_model(ff.EngineConfig(model_config=tiny_qwen2_config().to_dict(),
                                            is_critic=True, dtype="float32"), mesh)
    export_hf(critic, root / "critic")
    values = ff.compute_values(critic, batch)["values"]
    if dist.get_rank() == 0:
        model, info = AutoModelForTokenClassification.from_pretrained(
            root / "critic", dtype=torch.float32, output_loading_info=True)
        with torch.no_grad():
            scores = model(input_ids=batch["input_ids"],
                           attention_mask=batch["attention_mask"].long()).logits[..., 0]
        mask = batch["attention_mask"][:, 1:]
        out["critic_err"] = float((scores[:, :-1] * mask - values[:, 1:]).abs().max())
        out["critic_scale"] = float(values.abs().max())
        out["critic_info"] = {k: list(v) for k, v in info.items() if v}
        out["critic_labels"] = model.config.num_labels
    return out if dist.get_rank() == 0 else None


@pytest.mark.timeout(180)
def test_export_hf_loads_in_transformers_with_the_same_logits(spmd2, tmp_path):
    out = spmd2.run(_export_cases, args=(str(tmp_path),), timeout=150)[0]
    # float32 end to end; the two forwards differ only in kernel order
    assert out["actor_err"] < 1e-5, out["actor_err"]
    assert out["actor_info"] == {}, out["actor_info"]  # no missing or unexpected keys
    assert "model.safetensors.index.json" in out["actor_files"]
    assert sum(f.endswith(".safetensors") for f in out["actor_files"]) > 1
    assert {"config.json", "generation_config.json"} <= set(out["actor_files"])
    assert not any(".tmp-" in f or f in ("OWNER", MARKER) for f in out["actor_files"])
    assert "lm_head.weight" not in out["tied_keys"] and "model.embed_tokens.weight" in \
        out["tied_keys"]
    assert out["tied_dtype"] == torch.bfloat16 and out["tied_config_dtype"] == "bfloat16"
    assert out["tied_tok"] == '{"fake": "tokenizer"}'
    assert "tokenizer_config.json" in out["tied_files"]
    assert out["tied_err"] < 1e-5, out["tied_err"]
    assert out["critic_err"] < 1e-5 and out["critic_scale"] > 1e-2, out
    assert out["critic_info"] == {} and out["critic_labels"] == 1


# ---------------------------------------------------------------- CheckpointError cases


def _error_cases(root):
    root = Path(root)
    rank0 = dist.get_rank() == 0
    state, _ = _steps(_state(), 1)
    save_checkpoint(state, root / "good", extra={"k": 1})
    infer = _state(optimizer=None)
    save_checkpoint(infer, root / "weights")

    def copy_of(name, edit):
        dst = root / name
        if rank0:
            shutil.copytree(root / "good", dst)
            edit(dst)
        dist.barrier()
        return dst

    def truncate(dst, fix_manifest):
        shard = dst / "__1_0.distcp"
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
        if fix_manifest:  # sizes and the manifest's CRC fixed: only DCP's own read can notice
            from fsdpfn.checkpoint.files import with_seal

            m = json.loads((dst / MANIFEST).read_text())
            m["files"]["__1_0.distcp"] = shard.stat().st_size
            (dst / MANIFEST).write_text(json.dumps(with_seal(m)))

    cases = {
        "missing": (root / "nope", {}),
        "no_marker": (copy_of("no_marker", lambda d: (d / MARKER).unlink()), {}),
        "no_metadata": (copy_of("no_metadata", lambda d: (d / ".metadata").unlink()), {}),
        "truncated": (copy_of("truncated", lambda d: truncate(d, False)), {}),
        "dcp_read_fails": (copy_of("dcp", lambda d: truncate(d, True)), {}),
        "no_optimizer_state": (root / "weights", {}),
        "bad_weights_only": (root / "good", {"weights_only": "yes"}),
    }
    results = {}
    for name, (path, kwargs) in cases.items():
        before = _local(state)
        try:
            state_after, _ = load_checkpoint(state, path, **kwargs)
            results[name] = ("no error", "", False)
            state = state_after
        except CheckpointError as exc:
            results[name] = ("CheckpointError", str(exc), _same(before, _local(state)))

    def attempt(target, path):
        """(outcome, message, target unchanged) of one load expected to fail."""
        before = _local(target)
        try:
            load_checkpoint(target, path)
            return ("no error", "", False)
        except CheckpointError as exc:
            return ("CheckpointError", str(exc), _same(before, _local(target)))

    # an inference-only state loading a checkpoint with optimizer state
    results["inference_state"] = attempt(infer, root / "good")
    # another architecture (vocabulary)
    results["vocab"] = attempt(_state(vocab_size=256), root / "good")
    # same architecture, other dtype: DCP would cast silently
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=-1), device_type="cpu")
    bf16 = ff.shard_model(ff.EngineConfig(model_config=tiny_qwen2_config().to_dict(),
                                          optimizer=None, optimizer_dtype="bfloat16"), mesh)
    save_checkpoint(bf16, root / "bf16")
    results["dtype"] = attempt(infer, root / "bf16")
    # bad save arguments
    for name, kwargs in (("extra_tuple", {"extra": {"pos": (1, 2)}}),
                         ("extra_object", {"extra": {"pos": object()}}),
                         ("keep_last", {"keep_last": 0})):
        try:
            save_checkpoint(state, root / name, **kwargs)
            results[name] = ("no error", "", False)
        except CheckpointError as exc:
            results[name] = ("CheckpointError", str(exc), not (root / name).exists())
    # saving over a directory that is not a checkpoint
    keep = root / "user_dir"
    if rank0:
        keep.mkdir()
        (keep / "notes.txt").write_text("mine")
    dist.barrier()
    try:
        save_checkpoint(state, keep)
        results["save_over_user_dir"] = ("no error", "", False)
    except CheckpointError as exc:
        results["save_over_user_dir"] = ("CheckpointError", str(exc),
                                         (keep / "notes.txt").read_text() == "mine")
    # the states are still usable, and weights_only loads cross the optimizer rules
    ok = ff.forward_logp(state, _batch())["logp"].isfinite().all().item()
    w_before = _local(state)
    infer2, extra = load_checkpoint(infer, root / "good", weights_only=True)
    state2, _ = load_checkpoint(state, root / "weights", weights_only=True)
    crossed = (_same({k: v for k, v in w_before.items() if k.startswith("o/")},
                     {k: v for k, v in _local(state2).items() if k.startswith("o/")})
               and state2.step == w_before["meta"][0] and extra == {"k": 1})
    try:
        save_checkpoint(state, root / "stale")
        stale = "no error"
    except StaleStateError as exc:
        stale = str(exc)
    return results, ok, crossed, stale, infer2.version


@pytest.mark.timeout(180)
def test_checkpoint_errors_leave_the_state_unchanged(spmd2, tmp_path):
    per_rank = spmd2.run(_error_cases, args=(str(tmp_path),), timeout=150)
    expect = {
        "missing": "does not exist",
        "no_marker": "without COMPLETE",
        "no_metadata": ".metadata",
        "truncated": "truncated",
        "dcp_read_fails": "dcp/__1_0.distcp",
        "no_optimizer_state": "weights_only=True",
        "bad_weights_only": "weights_only: must be a bool",
        "inference_state": "inference-only",
        "vocab": "architecture.vocab_size",
        "save_over_user_dir": "refusing to delete",
        "dtype": "dtype must be torch.float32",
        "extra_tuple": "lists rather than tuples",
        "extra_object": "must be JSON-able",
        "keep_last": "keep_last: must be an integer >= 1",
    }
    for rank, (results, ok, crossed, stale, version) in enumerate(per_rank):
        for name, needle in expect.items():
            kind, message, unchanged = results[name]
            assert kind == "CheckpointError", f"rank {rank} {name}: {kind}"
            assert needle in message, f"rank {rank} {name}: {message}"
            assert unchanged, f"rank {rank} {name}: the state changed: {message}"
        assert ok and crossed
        assert "superseded by load_checkpoint" in stale
        assert version == 2  # max(0, 1) + 1
    # messages name the path
    assert str(tmp_path / "nope") in per_rank[0][0]["missing"][1]


# ---------------------------------------------------------------- corrupted data (checksums)


def _save_for_corruption(root):
    root = Path(root)
    state, _ = _steps(_state(), 1)
    save_checkpoint(state, root / "sync")
    save_checkpoint(state, root / "async", async_save=True).wait()
    save_checkpoint(state, root / "unchecked", checksums=False)
    return _full(state)


def _xor_middle(file: Path, n=4096):
    data = bytearray(file.read_bytes())
    mid = len(data) // 2
    data[mid:mid + n] = bytes(b ^ 0xA5 for b in data[mid:mid + n])
    file.write_bytes(bytes(data))  # same size: the manifest's size check passes


def _xor_largest_chunk(root: Path, rel: str, n=4096):
    """XOR n bytes in the middle of the largest tensor chunk stored in ``root / rel``: inside
    its raw data, where torch's loader sees nothing wrong. Returns the chunk's key."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(root)).read_metadata()
    index, info = max(((i, s) for i, s in md.storage_data.items() if s.relative_path == rel),
                      key=lambda x: x[1].length)
    file = root / rel
    data = bytearray(file.read_bytes())
    mid = info.offset + info.length // 2 - n // 2
    data[mid:mid + n] = bytes(b ^ 0xA5 for b in data[mid:mid + n])
    file.write_bytes(bytes(data))
    return index.fqn


def _negate_q_proj_pair(root: Path, rel: str):
    """Negate two float32 weights of a q_proj chunk in ``root / rel`` (sign bits of words 4 and
    6 of its data: positions adding to an even number, which the earlier sums modulo 2**32 could
    not see). Returns the chunk's key."""
    import io

    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(root)).read_metadata()
    index, info = next((i, s) for i, s in sorted(md.storage_data.items(), key=lambda x: x[0].fqn)
                       if s.relative_path == rel and i.fqn.startswith("model.")
                       and i.fqn.endswith("q_proj.weight"))
    file = root / rel
    data = bytearray(file.read_bytes())
    blob = bytes(data[info.offset:info.offset + info.length])
    chunk = torch.load(io.BytesIO(blob), weights_only=True)
    start = info.offset + blob.index(chunk.contiguous().view(-1)[:16].numpy().tobytes())
    for word in (4, 6):
        data[start + 4 * word + 3] ^= 0x80
    file.write_bytes(bytes(data))
    return index.fqn


def _zero_tail(file: Path, n=4096):
    data = bytearray(file.read_bytes())
    data[-n:] = bytes(n)
    file.write_bytes(bytes(data))


def _flip_pickled_item(root: Path):
    """Flip one byte inside the first pickled item (an optimizer hyper-parameter) of DCP."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    md = FileSystemReader(str(root)).read_metadata()
    index, info = next((i, s) for i, s in sorted(md.storage_data.items(), key=lambda x: x[0].fqn)
                       if isinstance(md.state_dict_metadata[i.fqn], BytesStorageMetadata))
    file = root / info.relative_path
    data = bytearray(file.read_bytes())
    data[info.offset + info.length // 2] ^= 0x01
    file.write_bytes(bytes(data))
    return info.relative_path, index.fqn


def _load_each(paths, dp):
    """{path: "ok" or the CheckpointError's message, with "[CHANGED]" if the state changed}."""
    state = _state(dp=dp, seed=7)
    out = {}
    for path in paths:
        before = _local(state)
        try:
            state, _ = load_checkpoint(state, path)
            out[path] = ("ok", _full(state))
        except CheckpointError as exc:
            out[path] = (str(exc) + ("" if _same(before, _local(state)) else " [CHANGED]"), None)
    return out


@pytest.mark.timeout(300)
def test_corrupted_shards_are_refused_naming_the_file_and_tensor(spmd1, spmd2, tmp_path):
    """XOR-ed 4 KiB in the middle of a .distcp (same size), two negated q_proj weights, a zeroed
    tail, a flipped byte in a pickled item and in .metadata: each load raises CheckpointError naming the file (and the
    tensor or item), on every rank, with the state unchanged; at the saved world size and at
    another one (the saved chunks' checksums are completed over the ranks); for async saves
    too. Clean copies load; a checkpoint saved with checksums=False loads unverified."""
    saved = spmd2.run(_save_for_corruption, args=(str(tmp_path),), timeout=150)[0]
    keys = {}
    edits = {"flip": ("sync", lambda d: _xor_middle(d / "__1_0.distcp")),
             "flip_data": ("sync", lambda d: keys.setdefault(
                 "flip_data", _xor_largest_chunk(d, "__1_0.distcp"))),
             "flip_async": ("async", lambda d: keys.setdefault(
                 "flip_async", _xor_largest_chunk(d, "__0_0.distcp"))),
             "negated": ("sync", lambda d: keys.setdefault(
                 "negated", _negate_q_proj_pair(d, "__1_0.distcp"))),
             "tail": ("sync", lambda d: _zero_tail(d / "__1_0.distcp")),
             "metadata": ("sync", lambda d: _xor_middle(d / ".metadata", 1))}
    for name, (source, edit) in edits.items():
        shutil.copytree(tmp_path / source, tmp_path / name)
        edit(tmp_path / name)
    shutil.copytree(tmp_path / "sync", tmp_path / "item")
    item_file, item_key = _flip_pickled_item(tmp_path / "item")
    expect = {
        # the file's middle: torch's loader fails (a header) or the checksum differs (data)
        "flip": [f"{tmp_path / 'flip' / '__1_0.distcp'}'", "the file is", "corrupted"],
        "flip_data": [f"{tmp_path / 'flip_data' / '__1_0.distcp'}'",
                      f"the chunk of tensor {keys['flip_data']!r}", "must have the checksum"],
        "flip_async": [f"{tmp_path / 'flip_async' / '__0_0.distcp'}'",
                       f"the chunk of tensor {keys['flip_async']!r}", "must have the checksum"],
        "negated": [f"{tmp_path / 'negated' / '__1_0.distcp'}'",
                    f"the chunk of tensor {keys['negated']!r}", "must have the checksum"],
        "tail": [f"{tmp_path / 'tail' / '__1_0.distcp'}'", "corrupted"],
        "metadata": [f"{tmp_path / 'metadata' / '.metadata'}'", "CRC32 must be"],
        "item": [f"{tmp_path / 'item' / item_file}'", f"the item {item_key!r}"],
    }
    paths = [str(tmp_path / n) for n in ("sync", "async", "unchecked", *expect)]
    for pool, dp in ((spmd2, 2), (spmd1, 1)):  # saved at dp=2; dp=1 reads chunks whole
        per_rank = pool.run(_load_each, args=(paths, dp), timeout=150)
        for rank, out in enumerate(per_rank):
            for name, needles in expect.items():
                message = out[str(tmp_path / name)][0]
                for needle in needles:
                    assert needle in message, f"dp={dp} rank {rank} {name}: {message}"
                assert "[CHANGED]" not in message, f"dp={dp} rank {rank} {name}: {message}"
            for name in ("sync", "async", "unchecked"):
                assert out[str(tmp_path / name)][0] == "ok", (dp, rank, name, out)
        for name in ("sync", "async", "unchecked"):
            _assert_equal_full(saved, per_rank[0][str(tmp_path / name)][1], f"{name} dp={dp}")
    assert "checksums" not in json.loads((tmp_path / "unchecked" / MANIFEST).read_text())
    chunks = json.loads((tmp_path / "sync" / MANIFEST).read_text())["checksums"]["chunks"]
    assert any(k.startswith("optim.state.") for k in chunks)  # Adam moments and steps too
    assert all(len(v) == 2 for k, v in chunks.items() if k.endswith("embed_tokens.weight"))


def _load_dp1_save(src, dst):
    state, _ = load_checkpoint(_state(dp=1, seed=3), src)
    save_checkpoint(state, dst)
    return True


@pytest.mark.timeout(510)
def test_a_chunk_split_over_ranks_is_verified_whole(spmd1, spmd2, tmp_path):
    """Saved at dp=1 (one chunk per tensor), loaded at dp=2: each rank reads half of a chunk;
    the halves' shares add up to the recorded checksum, so a flip on either half is caught."""
    spmd2.run(_save_for_corruption, args=(str(tmp_path / "src"),), timeout=150)
    spmd1.run(_load_dp1_save, args=(str(tmp_path / "src" / "sync"), str(tmp_path / "one")),
              timeout=150)
    shutil.copytree(tmp_path / "one", tmp_path / "flip")
    _xor_largest_chunk(tmp_path / "flip", "__0_0.distcp")
    out = spmd2.run(_load_each, args=([str(tmp_path / "one"), str(tmp_path / "flip")], 2),
                    timeout=150)
    for rank in range(2):
        assert out[rank][str(tmp_path / "one")][0] == "ok"
        message = out[rank][str(tmp_path / "flip")][0]
        assert f"{tmp_path / 'flip' / '__0_0.distcp'}'" in message, message
        assert "must have the checksum" in message and "[CHANGED]" not in message, message


# ---------------------------------------------------------------- async save and rotation


def _rotation(root):
    root = Path(root)
    state = _state()
    handles = []
    for step in (1, 2, 3, 4):
        handle = save_checkpoint(state, root / f"step_{step}", keep_last=2,
                                 async_save=step == 3)
        if handle is not None:
            handle.wait()
        handles.append(handle is not None)
    # replace in place: same path, new content
    save_checkpoint(state, root / "step_4", keep_last=2, extra={"again": True})
    names = sorted(p.name for p in root.iterdir())
    # a checkpoint of a state that never stepped has no Adam moments; loading it into a state
    # that has some restores exactly that: the next step equals a fresh state's first step
    stepped, _ = _steps(_state(seed=4), 1)
    loaded, _ = load_checkpoint(stepped, root / "step_4")
    empty = (len(loaded.optimizer.state), loaded.step, loaded.scheduler.last_epoch)
    a, loss_a = _steps(loaded, 1)
    b, loss_b = _steps(_state(), 1)
    full_a, full_b = _full(a), _full(b)
    same = full_a is None or (full_a.keys() == full_b.keys()
                              and all(torch.equal(full_a[k], full_b[k]) for k in full_a))
    return names, handles, empty, loss_a == loss_b and same


def _async_copy(root, per_layer=False):
    root = Path(root)
    fsdp = ff.FSDPConfig(per_layer_optim_step=per_layer)
    state, _ = _steps(_state(fsdp=fsdp), 1)
    handle = save_checkpoint(state, root / "step_1", async_save=True, extra={"s": 1})
    at_save = _full(state)
    state, _ = _steps(state, 2)  # mutates parameters and moments while the write may run
    handle.wait()
    loaded, extra = load_checkpoint(_state(seed=3, fsdp=fsdp), root / "step_1")
    got = _full(loaded)
    same = at_save is None or (at_save.keys() == got.keys()
                               and all(torch.equal(at_save[k], got[k]) for k in at_save))
    return same, extra, loaded.step


def _many_async(root, n):
    root = Path(root)
    state = _state()
    for i in range(n):
        save_checkpoint(state, root / f"step_{i}", keep_last=2, async_save=True).wait()
        if i % 3 == 2:  # a synchronous save between, over the default group
            save_checkpoint(state, root / f"step_{i}s", keep_last=2)
    return sorted(p.name for p in root.iterdir())


@pytest.mark.timeout(180)
def test_asynchronous_saves_in_a_row_never_wait_on_each_other(spmd2, tmp_path):
    """The staging agreement and the background write never share a group: when they did, the
    ranks could order the two differently and wait for each other for ever (a race that
    showed within ten saves)."""
    names = spmd2.run(_many_async, args=(str(tmp_path / "r"), 30), timeout=120)[0]
    assert names == ["step_29", "step_29s"], names


def _save_across_a_new_default_group(root):
    root = Path(root)
    save_checkpoint(_state(), root / "a", async_save=True).wait()  # its group is retired
    # the job tears its default group down and makes a new one (its groups' names start over)
    rank = dist.get_rank()
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{root / 'store'}", rank=rank,
                            world_size=2)
    state = _state()
    save_checkpoint(state, root / "b", async_save=True).wait()
    save_checkpoint(state, root / "c")
    return sorted(p.name for p in root.iterdir() if p.name != "store")


@pytest.mark.timeout(180)
def test_a_retired_group_of_a_destroyed_default_group_is_forgotten(tmp_path):
    """Groups retired before the default group was destroyed went with it: the next save does
    not try to destroy them again (nor one of the new groups that reuses their names)."""
    out = run_spmd(_save_across_a_new_default_group, 2, args=(str(tmp_path),), timeout=120)
    assert out == [["a", "b", "c"]] * 2, out


def _policy_and_critic_saves(root, async_save):
    from fsdpfn.app.recipes.config import CheckpointConfig
    from fsdpfn.app.recipes.runtime import Checkpoints

    root, state = Path(root), _state()
    saves = Checkpoints(CheckpointConfig(keep_last=1, async_save=async_save))
    seen = []
    for step in (1, 2, 3):
        name = f"step_{step:06d}"
        saves.save([(state, root / "critic_checkpoints" / name, {"step": step}),
                    (state, root / "checkpoints" / name, {"step": step})], final=False)
        saves.wait()
        seen.append([sorted(p.name for p in (root / d).iterdir())
                     for d in ("checkpoints", "critic_checkpoints")])
    return seen


@pytest.mark.timeout(180)
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_the_critic_keeps_the_partner_of_the_policy_checkpoint_resume_reads(spmd2, tmp_path,
                                                                            async_save):
    """PPO saves the critic, then the policy. With keep_last=1 the critic's rotation deleted
    the partner of the policy checkpoint --resume reads until the new policy one is published:
    a crash between the two made the run impossible to resume. The critic keeps one more."""
    seen = spmd2.run(_policy_and_critic_saves, args=(str(tmp_path), async_save),
                     timeout=120)[0]
    assert seen == [[["step_000001"], ["step_000001"]],
                    [["step_000002"], ["step_000001", "step_000002"]],
                    [["step_000003"], ["step_000002", "step_000003"]]], seen


@pytest.mark.timeout(180)
def test_async_save_of_the_per_layer_step_holds_its_moments(spmd2, tmp_path):
    """The per-layer step keeps its Adam moments in reserved blocks of host memory, views at an
    offset that torch's stager could not copy: every asynchronous save of such a state failed
    ("invalid python storage"), and the recipes save asynchronously by default."""
    for same, extra, step in spmd2.run(_async_copy, args=(str(tmp_path / "a"), True),
                                       timeout=120):
        assert same and extra == {"s": 1} and step == 1


@pytest.mark.timeout(300)
def test_async_save_and_keep_last(spmd2, tmp_path):
    for same, extra, step in spmd2.run(_async_copy, args=(str(tmp_path / "a"),), timeout=120):
        assert same and extra == {"s": 1} and step == 1
    run = tmp_path / "run"
    run.mkdir()
    (run / "not_a_checkpoint").mkdir()
    names, handles, empty, same = spmd2.run(_rotation, args=(str(run),), timeout=120)[0]
    assert empty == (0, 0, 0) and same
    assert handles == [False, False, True, False]
    assert names == ["not_a_checkpoint", "step_3", "step_4"]
    assert json.loads((run / "step_4" / MANIFEST).read_text())["extra"] == {"again": True}
