"""Stage times, peak memory, tokens/s and MFU in the stats; last_timings for forward-only calls;
fsdpfn.profile traces that load as JSON; PushReceipt's gather / transfer / apply split."""

from __future__ import annotations

import json
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import fsdpfn as ff
from fsdpfn import keys as K
from fsdpfn.engine import timing
from fsdpfn.testing import random_batch, tiny_qwen2_config, tiny_qwen3_config

STAGE_KEYS = [f"time_{s}" for s in timing.STAGES]
KEYS = [*STAGE_KEYS, "time_total", "peak_memory_gb", "tokens_per_s"]


def _state(**overrides):
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=1), device_type="cpu")
    cfg = ff.EngineConfig(model_config=tiny_qwen2_config().to_dict(), dtype="float32",
                          mb_spec=ff.MicroBatchSpec(n_mbs=2), **overrides)
    return ff.shard_model(cfg, mesh)


def _batch(seed: int = 1):
    return random_batch(6, 12, seed=seed)


def _numbers(stats) -> dict[str, float]:
    return {k: float(v) for k, v in stats.items()}


def _assert_adds_up(numbers: dict[str, float]) -> None:
    for key in KEYS:
        assert key in numbers, (key, sorted(numbers))
        assert numbers[key] >= 0, (key, numbers[key])
    stages = sum(numbers[k] for k in STAGE_KEYS)
    assert stages <= numbers["time_total"] * (1 + 1e-5), (stages, numbers)


# ---------------------------------------------------------------- the clock alone


@settings(max_examples=25, deadline=None, derandomize=True, database=None)
@given(st.lists(st.tuples(st.sampled_from(timing.STAGES), st.integers(0, 3)), max_size=8))
def test_clock_stages_partition_the_call_and_stay_within_its_wall_time(marks):
    """Whatever the order of stage marks, each stage gets the time from its mark to the next,
    and the stages add up to at most the host wall time of the call."""
    clock = timing.Clock(torch.device("cpu"), measure=True, ranges=False)
    expected = dict.fromkeys(timing.STAGES, 0.0)
    for stage, ms in marks:
        clock.enter(stage)
        begin = time.perf_counter()
        time.sleep(ms / 1e4)
        expected[stage] += time.perf_counter() - begin
    out = clock.close()
    assert set(timing.STAGES) | {"total"} <= set(out)
    assert sum(out[s] for s in timing.STAGES) <= out["total"]
    for stage in timing.STAGES:
        assert out[stage] >= expected[stage] - 1e-9, (stage, out, expected)


def test_region_outside_a_timed_call_is_a_no_op_and_inside_is_summed():
    with timing.region("gather"):
        pass
    with timing.clock_for(torch.device("cpu")) as clock:
        for _ in range(3):
            with timing.region("gather"):
                time.sleep(0.002)
    assert 0.006 <= clock.result["gather"] <= clock.result["total"]


# ---------------------------------------------------------------- training and forward calls


@pytest.fixture(scope="module")
def state_box():
    return [_state(peak_tflops=2.0)]


def test_step_stats_carry_stage_times_within_the_wall_time(state_box):
    state, stats = ff.sft_step(state_box[0], _batch())
    state_box[0] = state
    numbers = _numbers(stats)
    _assert_adds_up(numbers)
    assert numbers["time_forward"] > 0 and numbers["time_backward"] > 0
    assert numbers["time_optimizer"] > 0 and numbers["peak_memory_gb"] > 0
    real = float(_batch()[K.ATTENTION_MASK].sum())
    assert numbers["tokens_per_s"] == pytest.approx(real / numbers["time_total"], rel=1e-5)
    kept = ff.last_timings(state)["sft_step"]  # the same numbers, kept with the model
    assert kept == pytest.approx({k: numbers[k] for k in timing.KEYS & numbers.keys()}, rel=1e-5)


def _reference_flops(batch, passes: int, cfg=None) -> float:
    """float64, from the config's dimensions alone: q, k, v, o, gate, up, down per layer and the
    (untied) lm_head; causal attention 2·len²·(heads · head_dim) per layer forward."""
    cfg = cfg or tiny_qwen2_config()
    h, i, L, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
    d = getattr(cfg, "head_dim", None) or h // cfg.num_attention_heads
    q, kv = d * cfg.num_attention_heads, d * cfg.num_key_value_heads
    params = L * (2 * h * q + 2 * h * kv + 3 * h * i) + V * h
    lens = batch[K.ATTENTION_MASK].sum(1).double()
    return passes * (2.0 * params * float(lens.sum()) + 2.0 * L * q * float((lens ** 2).sum()))


def test_mfu_follows_the_documented_formula(state_box):
    batch = _batch(seed=2)
    state, stats = ff.sft_step(state_box[0], batch)
    state_box[0] = state
    numbers = _numbers(stats)
    expected = _reference_flops(batch, 3) / (numbers["time_total"] * 2.0e12)
    assert numbers["mfu"] == pytest.approx(expected, rel=1e-5)
    ff.forward_logp(state, batch)
    fwd = ff.last_timings(state)["forward_logp"]
    assert fwd["mfu"] == pytest.approx(_reference_flops(batch, 1) / (fwd["time_total"] * 2e12),
                                       rel=1e-9)


def test_mfu_counts_attention_at_heads_times_head_dim():
    """Qwen3-style configs set head_dim apart from hidden / heads: attention's FLOPs follow it."""
    cfg = tiny_qwen3_config()
    cfg.head_dim = 2 * cfg.hidden_size // cfg.num_attention_heads  # 4 · 32 = 128 on hidden 64
    mesh = ff.build_mesh(ff.ParallelStrategy(dp=1), device_type="cpu")
    state = ff.shard_model(ff.EngineConfig(model_config=cfg.to_dict(), dtype="float32",
                                           peak_tflops=2.0), mesh)
    batch = _batch(seed=4)
    ff.forward_logp(state, batch)
    fwd = ff.last_timings(state)["forward_logp"]
    assert fwd["mfu"] == pytest.approx(_reference_flops(batch, 1, cfg) / (fwd["time_total"] * 2e12),
                                       rel=1e-9)


def test_forward_logp_keeps_the_batch_format_and_reports_through_last_timings(state_box):
    batch = _batch(seed=3)
    out = ff.forward_logp(state_box[0], batch, out_key="old_logp")
    assert set(out.keys()) == set(batch.keys()) | {"old_logp"}
    numbers = ff.last_timings(state_box[0])["forward_logp"]
    _assert_adds_up(numbers)
    assert numbers["time_forward"] > 0
    assert numbers["time_backward"] == 0 and numbers["time_optimizer"] == 0


def test_evaluate_stats_carry_the_forward_numbers(state_box):
    from fsdpfn.algos.sft import sft_loss_fn

    stats = ff.evaluate(state_box[0], _batch(seed=4), sft_loss_fn(ff.SFTConfig()))
    numbers = _numbers(stats)
    _assert_adds_up(numbers)
    assert numbers["time_backward"] == 0


def test_timing_off_adds_no_keys_and_changes_no_numbers():
    on, off = _state(), _state(timing=False)
    assert ff.last_timings(off) == {}
    on, stats_on = ff.sft_step(on, _batch())
    off, stats_off = ff.sft_step(off, _batch())
    assert not any(k.startswith("time_") or k in ("mfu", "tokens_per_s", "peak_memory_gb")
                   for k in stats_off.keys())
    for key in stats_off.keys():
        assert float(stats_off[key]) == float(stats_on[key]), key
    assert "mfu" not in stats_on.keys()  # CPU and no EngineConfig.peak_tflops: no rate known
    ff.forward_logp(off, _batch())
    assert ff.last_timings(off) == {}


def test_engine_config_timing_fields_are_validated():
    assert ff.EngineConfig(model_path="x").timing is True
    assert ff.EngineConfig(model_path="x", peak_tflops=989).peak_tflops == 989.0
    with pytest.raises(ff.ConfigError, match="peak_tflops"):
        ff.EngineConfig(model_path="x", peak_tflops=0)
    with pytest.raises(ff.ConfigError, match="timing"):
        ff.EngineConfig(model_path="x", timing="yes")


# ---------------------------------------------------------------- profile


def _trace_names(path) -> set[str]:
    events = json.loads(path.read_text())["traceEvents"]
    return {e.get("name") for e in events if isinstance(e, dict)}


def test_profile_writes_the_chosen_steps_as_chrome_json_with_stage_ranges(state_box, tmp_path):
    state = state_box[0]
    with ff.profile(tmp_path, steps=[1]) as session:
        for _ in range(3):
            batch = ff.forward_logp(state, _batch(), out_key="old_logp")
            state, _ = ff.sft_step(state, batch)
    state_box[0] = state
    assert [p.name for p in session.written] == ["step1_rank0.json"]
    names = _trace_names(session.written[0])
    for name in ("fsdpfn.sft_step", "fsdpfn.forward_logp", "fsdpfn.plan", "fsdpfn.forward",
                 "fsdpfn.backward", "fsdpfn.optimizer", "fsdpfn.comm"):
        assert name in names, (name, sorted(n for n in names if n and "fsdpfn" in n))


def test_profile_without_steps_traces_the_whole_block(state_box, tmp_path):
    with ff.profile(tmp_path / "all", memory=True) as session:
        ff.forward_logp(state_box[0], _batch())
        ff.push_weights(state_box[0], ff.DiskTarget(tmp_path / "w"))
    assert [p.name for p in session.written] == ["trace_rank0.json"]
    names = _trace_names(session.written[0])
    assert {"fsdpfn.forward_logp", "fsdpfn.push_weights", "fsdpfn.gather"} <= names


@pytest.mark.parametrize("steps", [[-1], ["1"], 3, [True]])
def test_profile_refuses_bad_steps_by_name(tmp_path, steps):
    with pytest.raises(ff.ConfigError, match="steps: must"):
        with ff.profile(tmp_path, steps=steps):
            pass


def test_profile_refuses_nesting(tmp_path):
    with ff.profile(tmp_path, steps=[]):
        with pytest.raises(ff.ConfigError, match="profile: already inside"):
            with ff.profile(tmp_path):
                pass


@pytest.mark.parametrize("key", ["memory", "record_shapes", "with_stack"])
def test_profile_refuses_a_flag_that_is_not_a_bool_by_name(tmp_path, key):
    """record_shapes="yes" reached torch's profiler and came back as its TypeError."""
    with pytest.raises(ff.ConfigError, match=rf"^{key}: must be a bool, got 'yes'$"):
        with ff.profile(tmp_path, **{key: "yes"}):
            pass


def test_a_profile_that_fails_to_start_leaves_no_session_behind(tmp_path, monkeypatch):
    """The session was set before the profiler started and outside the block that resets it:
    a start that raised left every later profile refused as nested."""
    class Broken:
        def __init__(self, **kwargs):
            pass

        def __enter__(self):
            raise RuntimeError("the profiler cannot start")

    with monkeypatch.context() as patch:
        patch.setattr(torch.profiler, "profile", Broken)
        with pytest.raises(RuntimeError, match="cannot start"):
            with ff.profile(tmp_path / "a"):
                pass
    with ff.profile(tmp_path / "b", steps=[]) as session:
        pass
    assert session.written == []


# ---------------------------------------------------------------- push receipts


def test_push_receipt_positional_construction_still_works():
    receipt = ff.PushReceipt(3, 10, 1024, 0.5)
    assert (receipt.version, receipt.seconds, receipt.gather_s, receipt.apply_s) == \
        (3, 0.5, None, None)


def test_push_receipt_splits_gather_and_transfer_within_its_seconds(state_box, tmp_path):
    began = time.perf_counter()
    receipt = ff.push_weights(state_box[0], ff.DiskTarget(tmp_path))
    wall = time.perf_counter() - began
    assert receipt.apply_s is None  # a directory applies nothing
    # the parts within the push's seconds, and those within the caller's own clock
    assert 0 < receipt.gather_s <= receipt.seconds <= wall
    assert 0 <= receipt.transfer_s <= receipt.seconds


def test_shard_model_records_where_the_build_went():
    """last_timings(state)["shard_model"]: one number per phase, adding up to the total, which
    the caller's own clock bounds; nothing with timing=False."""
    began = time.perf_counter()
    state = _state()
    wall = time.perf_counter() - began
    build = ff.last_timings(state)["shard_model"]
    phases = ("check", "skeleton", "wrap", "materialize", "weights", "optimizer")
    assert set(build) == {f"time_{p}" for p in phases} | {"time_total"}
    assert all(v >= 0 for v in build.values())
    assert sum(build[f"time_{p}"] for p in phases) == pytest.approx(build["time_total"], rel=1e-9)
    assert build["time_total"] <= wall
    assert "shard_model" not in ff.last_timings(_state(timing=False))
