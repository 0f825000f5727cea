"""A CPU run against its host's memory (fsdpfn.app.recipes.cpu_memory): the estimate written out
by hand for a small shape, the refusal and the options it offers, and the check reached from
`fsdpfn run --dry-run`. Before, a CPU run of a model too big for the host was killed by the
kernel part way in ("trainer rank 1 was killed by SIGKILL").

The constants are measured: a Qwen2-0.5B shape's sft run (2 CPU ranks, float32, random init)
peaked at 11.9 GiB of resident memory over its process tree, at its checkpoint and export, and
the estimate says 11.9 GiB (BENCHMARKS.md, "Memory of a CPU run")."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from fsdpfn.app.recipes import default_config
from fsdpfn.app.recipes.cpu_memory import (RANK_PROCESS_BYTES, SERVER_PROCESS_BYTES,
                                           check_cpu_memory, cpu_estimate)
from fsdpfn.app.recipes.memory import HEADROOM, GiB, ModelShape, estimate_memory
from fsdpfn.app.recipes.placement import Placement
from fsdpfn.errors import ConfigError

HF = {"hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 4, "vocab_size": 32,
      "num_attention_heads": 2, "num_key_value_heads": 1}
SHAPE = ModelShape.from_hf(HF)  # 2,888 parameters


def _placement(nproc=2, servers=0):
    return Placement(device="cpu", nproc=nproc, trainer_gpus=(),
                     server_device="cpu" if servers else None, server_gpus=(),
                     transport="broadcast", dtype="float32", servers=servers)


def test_the_estimate_by_hand():
    cfg = default_config("sft")
    est = cpu_estimate(cfg, SHAPE, nproc=2, dtype="float32", servers=0)
    # the state once over the ranks, float32: weights and gradients 4 B x 2888, Adam 8 B x 2888
    assert (est["weights"], est["gradients"], est["optimizer"]) == (11552, 11552, 23104)
    # each rank gathers two layers and the root in float32, 4 x (2 x 592 + 520) = 6816, and
    # one layer's gradient 4 x 592 = 2368, beside its own micro-batch's activations
    one = estimate_memory(SHAPE, cfg.engine.__class__(dtype="float32"), n_gpus=2,
                          tokens=_tokens(cfg))
    assert one["gathered"] == 6816 + 2368
    assert est["gathered + activations"] == 2 * (one["gathered"] + one["activations"])
    assert est["a full copy (saves, pushes)"] == 4 * 2888
    assert est["processes"] == 2 * RANK_PROCESS_BYTES == 1 * GiB
    assert "rollout servers" not in est
    assert est["total"] == pytest.approx(sum(v for k, v in est.items() if k != "total"))
    # grpo: a server's float32 weights and its process; the reference's fp32 shards
    grpo = cpu_estimate(default_config("grpo"), SHAPE, nproc=2, dtype="float32", servers=1)
    assert grpo["rollout servers"] == 4 * 2888
    assert grpo["processes"] == 2 * RANK_PROCESS_BYTES + SERVER_PROCESS_BYTES
    assert grpo["weights"] == 2 * 11552  # the policy's and the reference's


def _tokens(cfg) -> int:
    from fsdpfn.app.recipes.memory import _tokens as tokens

    return tokens(cfg, cfg.engine, 2)


# a Qwen2-1.5B-shaped model: 1.54e9 parameters, 24.7 GB of float32 weights, gradients and Adam
Q15 = ModelShape.from_hf({"hidden_size": 1536, "intermediate_size": 8960,
                          "num_hidden_layers": 28, "vocab_size": 151936,
                          "num_attention_heads": 12, "num_key_value_heads": 2,
                          "tie_word_embeddings": True})


def test_a_run_too_big_for_the_host_is_refused_naming_what_fits():
    cfg = default_config("sft")
    with pytest.raises(ConfigError) as info:
        check_cpu_memory(cfg, Q15, _placement(), available=24 * GiB)
    msg = str(info.value)
    assert msg.startswith("engine: the run does not fit this host's memory, host memory "
                          "estimate of this CPU run (2 trainer rank(s)): "), msg
    assert "GiB of 24.0 GiB available" in msg and "more than 90% of it" in msg
    assert msg.endswith("; it would fit with engine.lora.rank=16"), msg
    with pytest.raises(ConfigError) as info:  # with more room the bf16 state fits too
        check_cpu_memory(cfg, Q15, _placement(), available=32 * GiB)
    assert str(info.value).endswith("; it would fit with engine.optimizer_dtype=bfloat16 or "
                                    "engine.lora.rank=16"), str(info.value)
    # the options that only move state to the host are not offered: on a CPU it is the host
    assert "per_layer_optim_step" not in msg and "offload" not in msg
    # each offered option does fit
    total = cpu_estimate(cfg, Q15, nproc=2, dtype="float32", servers=0)["total"]
    assert total > HEADROOM * 24 * GiB
    assert check_cpu_memory(cfg, Q15, _placement(), available=total / HEADROOM + 1) \
        .startswith("host memory estimate of this CPU run (2 trainer rank(s)): ")
    assert check_cpu_memory(cfg, Q15, _placement(), available=None) is None
    with pytest.raises(ConfigError, match="no option makes it fit: use a smaller model, or a "
                                          "GPU host$"):
        check_cpu_memory(cfg, Q15, _placement(), available=2 * GiB)


def test_fewer_ranks_are_offered_where_the_ranks_own_memory_is_what_does_not_fit():
    cfg = default_config("sft")
    eight = cpu_estimate(cfg, SHAPE, nproc=8, dtype="float32", servers=0)["total"]
    one = cpu_estimate(cfg, SHAPE, nproc=1, dtype="float32", servers=0)["total"]
    available = (one / HEADROOM + eight / HEADROOM) / 2
    with pytest.raises(ConfigError, match=r"it would fit with launch\.nproc=1$"):
        check_cpu_memory(cfg, SHAPE, _placement(nproc=8), available=available)


def test_the_dry_run_refuses_it_before_launch(tmp_path, monkeypatch):
    """The refusal reached from the command line, on a model directory holding only a
    config.json (random_init), with the host's memory as the preflight reads it."""
    from fsdpfn.app import cli
    from fsdpfn.app.recipes import preflight
    from fsdpfn.testing import write_tiny_hf_dir

    model = tmp_path / "q15"
    write_tiny_hf_dir(model, texts=["1+1=2"] * 8)
    config = json.loads((model / "config.json").read_text())
    config.update(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                  vocab_size=151936, num_attention_heads=12, num_key_value_heads=2,
                  tie_word_embeddings=True, max_position_embeddings=4096)
    (model / "config.json").write_text(json.dumps(config))
    for f in model.glob("*.safetensors"):
        f.unlink()
    monkeypatch.setattr(preflight, "available_host_memory", lambda: 24 * GiB)
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        rc = cli.main(["run", "sft", f"run_dir={tmp_path / 'r'}", f"model.path={model}",
                       "model.random_init=true", "launch.device=cpu", "--dry-run"])
    line = err.getvalue().strip().splitlines()[-1]
    assert rc == 2 and line.startswith("fsdpfn: error: engine: the run does not fit this "
                                       "host's memory"), line
    assert not (tmp_path / "r").exists()
