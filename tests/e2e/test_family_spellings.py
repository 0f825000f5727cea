"""A model whose config.json spells the standard names its own way (GPT-2's n_embd, n_layer,
n_head, n_positions; MPT's d_model, n_layers, n_heads) reaches the engine from a recipe: the
launcher's preflight reads its shape and position limit through transformers' own aliases of
that family. Before, ``fsdpfn run`` on a GPT-2 directory stopped in the launcher with a
KeyError traceback ('num_attention_heads'), before the engine's model guard could check it.

References: transformers' config object of the same dict (its attribute_map), and the
engine's own guard, which checks GPT-2 against its own forward when it is built."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from fsdpfn.app.recipes.model import standard_names
from fsdpfn.errors import ConfigError
from fsdpfn.testing import write_tiny_hf_dir

TEXTS = ["12+34=46", "7+8=15", "99+1=100", "0123456789+="] * 20


@pytest.mark.parametrize("kind, spelled, ffn", [
    ("gpt2", {"n_embd": 48, "n_layer": 3, "n_head": 4, "n_positions": 64, "vocab_size": 99,
              "n_inner": None}, 4 * 48),                  # GPT-2's MLP: 4 x n_embd when None
    ("ctrl", {"n_embd": 48, "n_layer": 3, "n_head": 4, "n_positions": 64, "vocab_size": 99,
              "dff": 200}, 200),
    ("opt", {"hidden_size": 48, "num_hidden_layers": 3, "num_attention_heads": 4,
             "max_position_embeddings": 64, "vocab_size": 99, "ffn_dim": 100}, 100),
    ("mpt", {"d_model": 48, "n_layers": 3, "n_heads": 4, "max_seq_len": 64,
             "vocab_size": 99}, 4 * 48),                  # expansion_ratio 4
    ("falcon", {"hidden_size": 48, "num_hidden_layers": 3, "num_attention_heads": 4,
                "vocab_size": 99}, 4 * 48),               # ffn_hidden_size None: 4 x hidden
])
def test_a_familys_own_names_read_as_transformers_reads_them(kind, spelled, ffn):
    """Of the 53 families the engine's guard accepts (docs/models.md), these spellings
    stopped ``fsdpfn run`` before: codegen, ctrl, gpt-sw3, gpt2, gpt_bigcode and gptj (n_*
    names), falcon, moshi and opt (no intermediate_size)."""
    from transformers import AutoConfig

    got = standard_names({"model_type": kind, **spelled}, "/m")
    reference = AutoConfig.for_model(kind, **spelled)
    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        assert got[name] == getattr(reference, name), name
    assert got["intermediate_size"] == ffn
    if kind in ("gpt2", "ctrl", "opt"):
        assert got["max_position_embeddings"] == reference.max_position_embeddings == 64


def test_a_name_no_spelling_gives_is_refused_by_name():
    with pytest.raises(ConfigError) as info:
        standard_names({"model_type": "gpt2", "n_embd": 48, "n_layer": 3, "vocab_size": 9},
                       "/m")
    assert str(info.value) == ("model.path: config.json must give the model's "
                               "num_attention_heads (an integer, under that name or its "
                               "family's own), got none in '/m/config.json' (model_type "
                               "'gpt2')")
    plain = {"hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
             "vocab_size": 9, "intermediate_size": 16}
    assert standard_names(plain, "/m") is plain  # the common case imports nothing


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory):
    """A tiny GPT-2 with the tokenizer files of the tiny test model."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    root = tmp_path_factory.mktemp("gpt2")
    tok_dir = write_tiny_hf_dir(root / "tok", texts=TEXTS, weights=False)
    vocab = json.loads((tok_dir / "config.json").read_text())["vocab_size"]
    eos = json.loads((tok_dir / "config.json").read_text())["eos_token_id"]
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=256,
                                       vocab_size=vocab, bos_token_id=eos, eos_token_id=eos))
    path = root / "model"
    model.save_pretrained(path)
    for f in tok_dir.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, path / f.name)
    return path


def _run(*args, timeout=200, recipe="sft"):
    return subprocess.run([sys.executable, "-m", "fsdpfn", "run", recipe, *args],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_sft_on_a_gpt2_directory_runs_and_its_position_limit_is_checked(gpt2_dir, tmp_path):
    proc = _run(f"model.path={gpt2_dir}", f"run_dir={tmp_path / 'run'}", "steps=2",
                "batch_size=8", "launch.nproc=1", "log.plot=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [json.loads(x)["loss"] for x in (tmp_path / "run" / "metrics.jsonl").read_text()
              .splitlines() if "loss" in json.loads(x)]
    assert len(losses) == 2 and all(0 < x < 20 for x in losses), losses
    config = json.loads((gpt2_dir / "config.json").read_text())
    config["n_positions"] = 4  # shorter than any of the task's rows
    short = tmp_path / "short"
    shutil.copytree(gpt2_dir, short)
    (short / "config.json").write_text(json.dumps(config))
    proc = _run(f"model.path={short}", f"run_dir={tmp_path / 'r2'}", "--dry-run", timeout=100)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "must be <= max_position_embeddings = 4 (model.path's config.json)" in proc.stderr


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_a_family_the_engine_refuses_is_refused_before_anything_starts(gpt2_dir, tmp_path):
    """A Mixtral directory: the ranks refuse it on its config (mixture-of-experts) as they
    build; ``--dry-run`` and a real run now say the same line before anything starts (no
    run_dir, no server, no rank), where the dry run passed and the real run failed in its
    ranks."""
    import torch
    from transformers import AutoModelForCausalLM, MixtralConfig

    torch.manual_seed(0)
    path = tmp_path / "mixtral"
    AutoModelForCausalLM.from_config(MixtralConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=300, num_local_experts=4)).save_pretrained(path)
    for f in gpt2_dir.iterdir():
        if f.name not in ("config.json", "model.safetensors", "generation_config.json"):
            shutil.copy(f, path / f.name)
    reason = ("model.path: model_type: 'mixtral' is not supported: a mixture-of-experts model")
    dry = _run(f"model.path={path}", f"run_dir={tmp_path / 'dry'}", "--dry-run", timeout=100)
    assert dry.returncode == 2, dry.stderr[-3000:]
    assert dry.stderr.strip().splitlines()[-1].startswith("fsdpfn: error: " + reason)
    assert not (tmp_path / "dry").exists()
    real = _run(f"model.path={path}", f"run_dir={tmp_path / 'real'}", "steps=1",
                "launch.nproc=1")
    assert real.returncode == 2, real.stderr[-3000:]
    assert real.stderr.strip().splitlines()[-1].startswith("fsdpfn: error: " + reason)
    assert not (tmp_path / "real").exists()


@pytest.mark.timeout(240)
def test_a_family_without_the_critics_head_is_refused_as_rws_and_ppos_critic(gpt2_dir,
                                                                              tmp_path):
    """GPT-2's token-classification model names its head 'classifier', not the 'score' the
    engine's value head reads: GPT-2 trains as a policy (above) but is refused, by name and
    before anything starts, as rw's reward model and ppo's value model. Before, rw started
    its rank and failed there, leaving a run_dir of 0 steps."""
    reason = ("fsdpfn: error: model.path: model_type 'gpt2' names its token-classification "
              "head ['dropout', 'classifier'], not 'score', which the engine's value head "
              "reads; this family is not supported as a critic (rw's reward model, ppo's "
              "value model; families verified as critics: llama, qwen2, qwen3, mistral, "
              "gemma, gemma2, phi3)")
    for recipe, extra in (("rw", []), ("ppo", ["--dry-run"])):
        run_dir = tmp_path / recipe
        proc = _run(f"model.path={gpt2_dir}", f"run_dir={run_dir}", "steps=1",
                    "launch.nproc=1", *extra, recipe=recipe, timeout=100)
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert proc.stderr.strip().splitlines()[-1] == reason, proc.stderr[-3000:]
        assert not run_dir.exists()
    # grpo trains no critic: the same directory passes the dry run
    proc = _run(f"model.path={gpt2_dir}", f"run_dir={tmp_path / 'grpo'}", "steps=1",
                "launch.nproc=1", "--dry-run", recipe="grpo", timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
