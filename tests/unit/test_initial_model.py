"""run_dir/model0, which trainer rank 0 writes as it starts (prepare_initial_model): the embedded
model's weights are HF's init under model.seed whichever process draws them, the drawing process's
own generator is left as it was, and the other ranks wait for the directory."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from fsdpfn.app.recipes.model import (CharTokenizer, ModelConfig, prepare_initial_model,
                                      write_initial_model)


@pytest.mark.timeout(120)
def test_rank_0_draws_hf_init_under_the_seed_and_leaves_its_own_generator_alone(tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = ModelConfig(seed=7)
    torch.manual_seed(123)
    prepare_initial_model(cfg, tmp_path, rank=0)
    after = torch.rand(4)
    torch.manual_seed(123)
    assert torch.equal(after, torch.rand(4))  # as if nothing had been drawn

    torch.manual_seed(7)  # the reference: HF's own init of the same config under the seed
    ref = AutoModelForCausalLM.from_config(cfg.hf_config(CharTokenizer().vocab_size),
                                           dtype=torch.float32).state_dict()
    saved = load_file(tmp_path / "model0" / "model.safetensors")
    assert set(saved) == set(ref)
    for name, value in saved.items():
        assert torch.equal(value, ref[name]), name
    assert (tmp_path / "model0" / "char_vocab.json").is_file()


@pytest.mark.timeout(60)
def test_the_other_ranks_wait_for_rank_0s_directory_and_give_up_naming_it(tmp_path):
    cfg = ModelConfig()
    writer = threading.Timer(0.5, lambda: write_initial_model(cfg, tmp_path / "model0",
                                                              CharTokenizer()))
    writer.start()
    start = time.monotonic()
    prepare_initial_model(cfg, tmp_path, rank=1, timeout_s=50)
    writer.join()
    assert time.monotonic() - start >= 0.5
    assert (tmp_path / "model0" / "config.json").is_file()

    with pytest.raises(TimeoutError, match=r"trainer rank 2: .*elsewhere.model0 has no "
                                           r"config.json after 0.2 s"):
        prepare_initial_model(cfg, tmp_path / "elsewhere", rank=2, timeout_s=0.2)
    # a model.path with weights: nothing to write or wait for
    prepare_initial_model(ModelConfig(path=str(tmp_path / "model0")), tmp_path / "x", rank=1,
                          timeout_s=0.0)
    assert not (tmp_path / "x").exists()
