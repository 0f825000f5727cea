"""Test helpers shipped for users: run_spmd (CPU ranks over gloo), tiny models, assertions.

Use them to test your own algorithms the way fsdpfn tests its own::

    from fsdpfn.testing import run_spmd, tiny_qwen2_config, assert_close_all_ranks
"""

from fsdpfn.testing.batches import random_batch, with_ppo_keys
from fsdpfn.testing.asserts import assert_all_ranks, assert_close_all_ranks
from fsdpfn.testing.models import (save_tiny_model, sharded_logits, tiny_llama_config,
                                   tiny_qwen2_config, tiny_qwen3_config)
from fsdpfn.testing.spmd import SpmdError, SpmdPool, SpmdTimeout, run_spmd
from fsdpfn.testing.hf_dir import train_tokenizer, write_tiny_hf_dir
from fsdpfn.testing.activations import layer_kept_bytes

__all__ = ["run_spmd", "SpmdPool", "SpmdError", "SpmdTimeout", "assert_all_ranks",
           "assert_close_all_ranks", "tiny_qwen2_config", "tiny_llama_config",
           "tiny_qwen3_config", "save_tiny_model", "sharded_logits", "random_batch",
           "with_ppo_keys", "train_tokenizer", "write_tiny_hf_dir", "layer_kept_bytes"]
