"""The memory estimate's parameter count against the model's own, per family shape.

    python benchmarks/param_count.py

The preflight's memory estimate (fsdpfn.app.recipes.memory) counts a model's parameters. Its
formulas read config.json as a llama-shaped layer (q, k, v, o; gate, up, down; two norms) and
embeddings; since the counts of the safetensors headers are read where they fit
(fsdpfn.engine.weight_files.counted_params), any family's layer is counted as its files hold it.
For published shapes of families whose layer is not llama-shaped (two-matrix MLPs, biases,
position tables, fused projections) and two that are, this prints the formulas' count, the
count the model transformers builds has (on the meta device: no weights, nothing downloaded),
and the headers' count of a small copy of the same architecture (a few layers, written with
random weights), scaled to the full depth as the estimate scales it.
"""

from __future__ import annotations

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _table import print_markdown_table  # noqa: E402

SHAPES = {  # name: (model_type, fields)
    "Falcon-7B": ("falcon", {}),
    "GPT-2 XL": ("gpt2", dict(n_embd=1600, n_layer=48, n_head=25)),
    "OPT-6.7B": ("opt", dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                             ffn_dim=16384, word_embed_proj_dim=4096,
                             max_position_embeddings=2048, vocab_size=50272)),
    "StarCoder2-7B": ("starcoder2", dict(hidden_size=4608, intermediate_size=18432,
                                         num_hidden_layers=32, num_attention_heads=36,
                                         num_key_value_heads=4, vocab_size=49152)),
    "Qwen2-7B": ("qwen2", dict(hidden_size=3584, intermediate_size=18944,
                               num_hidden_layers=28, num_attention_heads=28,
                               num_key_value_heads=4, vocab_size=152064)),
    "Llama-3.2-1B": ("llama", dict(hidden_size=2048, intermediate_size=8192,
                                   num_hidden_layers=16, num_attention_heads=32,
                                   num_key_value_heads=8, vocab_size=128256,
                                   tie_word_embeddings=True)),
}
LAYER_KEYS = ("num_hidden_layers", "n_layer")


def main() -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from fsdpfn.app.recipes.memory import ModelShape
    from fsdpfn.app.recipes.model import standard_names

    rows = []
    for name, (model_type, fields) in SHAPES.items():
        config = AutoConfig.for_model(model_type, **fields)
        shape = ModelShape.from_hf(standard_names(config.to_dict(), "/m"))
        with torch.device("meta"):
            full = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
        # a 2-layer copy with real (random) weights: its headers give a layer's and the root's
        small = AutoConfig.for_model(model_type, **{
            **fields, **{k: 2 for k in LAYER_KEYS if k in config.to_dict()}})
        with tempfile.TemporaryDirectory() as tmp:
            AutoModelForCausalLM.from_config(small).save_pretrained(tmp)
            counted = ModelShape.from_hf(standard_names(small.to_dict(), "/m")).counted(tmp)
        headers = shape.layers * counted.layer_params + counted.root_params
        rows.append({"shape": name, "model_type": model_type,
                     "formulas (B)": f"{shape.params / 1e9:.3f}",
                     "transformers (B)": f"{full / 1e9:.3f}",
                     "headers (B)": f"{headers / 1e9:.3f}",
                     "formulas / transformers": f"{shape.params / full:.2f}",
                     "headers / transformers": f"{headers / full:.3f}"})
    print_markdown_table(rows, ("shape",))


if __name__ == "__main__":
    main()
