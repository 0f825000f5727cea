"""The memory estimate's activation term against what a layer keeps on this device, per family.

    python benchmarks/act_memory.py [--rows 2048 8192] [--layers 2 4]

The preflight's estimate (fsdpfn.app.recipes.memory.ModelShape.act_bytes_layer) counts what one
decoder layer keeps for the backward: linear in the tokens, plus each head's scores (quadratic
in the row) where softcapped logits leave flash attention. tests/unit/test_memory_activations.py
holds it against the CPU's path in float32; this script measures the GPU's: bf16, torch's flash
varlen attention, Liger's norm and SwiGLU kernels where installed (as shard_model swaps them
in). For each family, a model of one width (hidden 2048, 16 heads of 128, 4 kv heads,
intermediate 5632) at two depths runs the engine's packed forward on one row, and
fsdpfn.testing.layer_kept_bytes gives the bytes one layer keeps for the backward (each storage
once, weights left out: the deeper minus the shallower, over the layers between). The estimate
before this term followed the family (a llama layer for every family) is shown beside it. The
peak column is the device's peak during forward and backward of the deeper model, above what
was allocated before the forward.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import attrs  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from _table import print_markdown_table  # noqa: E402
from fsdpfn.app.recipes.memory import ModelShape  # noqa: E402
from fsdpfn.testing.activations import layer_kept_bytes  # noqa: E402

WIDTH = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_attention_heads=16,
             num_key_value_heads=4, head_dim=128, max_position_embeddings=65536, pad_token_id=0,
             bos_token_id=1, eos_token_id=2)
FAMILIES = {
    "llama": {}, "qwen3": {}, "olmo2": {}, "phi3": {},
    "gemma2": dict(attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                   query_pre_attn_scalar=128, sliding_window=4096),
    "gemma2 without softcap": dict(attn_logit_softcapping=None, query_pre_attn_scalar=128,
                                   sliding_window=4096),
    "gemma3_text": dict(query_pre_attn_scalar=128, sliding_window=1024),
}
MiB = 2 ** 20


def _config(name: str, layers: int = 2):
    return transformers.AutoConfig.for_model(name.split(" ")[0], **WIDTH, **FAMILIES[name],
                                             num_hidden_layers=layers)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--layers", type=int, nargs=2, default=[2, 4])
    args = p.parse_args()
    lo, hi = args.layers
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}")
    rows = []
    for name in FAMILIES:
        shape = ModelShape.from_hf(_config(name).to_dict())
        before = attrs.evolve(shape, norms=2, qk_norm=False, softcap=False)
        for row in args.rows:
            layer, peak = layer_kept_bytes(_config(name), [row], dtype=torch.bfloat16,
                                           device="cuda", layers=(lo, hi))
            est = shape.act_bytes_layer(row, row, 2)
            rows.append({"family": name, "row": f"{row:,}",
                         "kept, one layer MiB": f"{layer / MiB:,.1f}",
                         "estimate MiB": f"{est / MiB:,.1f}",
                         "estimate / kept": f"{est / layer:.2f}",
                         "llama-shaped estimate / kept":
                             f"{before.act_bytes_layer(row, row, 2) / layer:.2f}",
                         f"peak of {hi} layers MiB": f"{peak / MiB:,.0f}"})
            print(rows[-1], flush=True)
    print_markdown_table(rows, ("family", "row"))


if __name__ == "__main__":
    main()
