"""What the memory estimate needs of a decoder-only model: its sizes from config.json (with the
parameter counts of its safetensors headers where they read as its layers) and what one layer
keeps for the backward, by family (fsdpfn.app.recipes.memory sums them into a run's estimate).

    shape = ModelShape.from_hf(config_json).counted(model_dir)
    shape.params, shape.act_bytes_layer(tokens, row, compute_bytes)
"""

from __future__ import annotations

import attrs

__all__ = ["ModelShape", "SANDWICH_NORMS", "QK_NORMS"]

# families whose decoder layers norm each sublayer's input and output (4 norms), and whose
# attention norms q and k per head (tests/unit/test_memory_activations.py checks each)
SANDWICH_NORMS = ("gemma2", "gemma3_text", "gemma3")
QK_NORMS = ("qwen3", "olmo2", "gemma3_text", "gemma3")


@attrs.frozen
class ModelShape:
    """What the estimate needs of a decoder-only model's config."""

    hidden: int
    intermediate: int
    layers: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool = False
    # the parameters counted in the weight files (fsdpfn.engine.weight_files.counted_params):
    # a decoder layer's (their mean) and the rest's; None: the formulas below, which read a
    # llama-shaped layer
    counted_layer: int | None = None
    counted_root: int | None = None
    # what a layer's autograd keeps beyond a llama layer's: norms over the hidden size (Gemma-2
    # and -3 norm each sublayer's input and output: 4), per-head q and k norms, and attention
    # logit softcapping, which leaves flash attention for an exact attention that keeps the
    # scores (fsdpfn.engine.attention: quadratic in each sequence's length)
    norms: int = 2
    qk_norm: bool = False
    softcap: bool = False

    @classmethod
    def from_hf(cls, c: dict) -> "ModelShape":
        heads = c["num_attention_heads"]
        family = c.get("model_type")
        return cls(hidden=c["hidden_size"], intermediate=c["intermediate_size"],
                   layers=c["num_hidden_layers"], vocab=c["vocab_size"], heads=heads,
                   kv_heads=c.get("num_key_value_heads") or heads,
                   head_dim=c.get("head_dim") or c["hidden_size"] // heads,
                   tied=bool(c.get("tie_word_embeddings", False)),
                   norms=4 if family in SANDWICH_NORMS else 2, qk_norm=family in QK_NORMS,
                   softcap=bool(c.get("attn_logit_softcapping")))

    @property
    def layer_params(self) -> int:
        """q, k, v, o projections, gate/up/down, two norms (or the weight files' count)."""
        if self.counted_layer is not None:
            return self.counted_layer
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return h * q + 2 * h * kv + q * h + 3 * h * self.intermediate + 2 * h

    @property
    def root_params(self) -> int:
        """Embedding, lm_head (unless tied) and the final norm (or the weight files' count)."""
        if self.counted_root is not None:
            return self.counted_root
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    def counted(self, path) -> "ModelShape":
        """This shape with the parameter counts of ``path``'s safetensors files, where they
        read as this shape's layers (counted_params); else this shape as it is."""
        from fsdpfn.engine.weight_files import counted_params

        counts = counted_params(path, self.layers)
        if counts is None:
            return self
        return attrs.evolve(self, counted_layer=counts[0], counted_root=counts[1])

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.root_params

    def lora_params(self, lora) -> int:
        """Adapter parameters: rank x (in + out) for each targeted linear of every layer."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, \
            self.kv_heads * self.head_dim, self.intermediate
        dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
        names = dims if "all-linear" in lora.target_modules else \
            [n for n in lora.target_modules if n in dims]
        return self.layers * sum(lora.rank * sum(dims[n]) for n in names)

    def act_bytes_per_token_layer(self, compute_bytes: int) -> int:
        """What autograd keeps per token in one layer: the norms' inputs and outputs (2h each),
        q, k, v and the attention output, gate, up, act(gate) and their product (4i), and the
        q and k norms' inputs and outputs where the family has them."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        qk = 2 * q + 2 * kv if self.qk_norm else 0
        return compute_bytes * (2 * self.norms * self.hidden + 2 * q + 2 * kv + qk
                                + 4 * self.intermediate)

    def attn_bytes_per_square_token(self) -> int:
        """Bytes a layer keeps per (query, key) pair of a sequence, in any compute dtype: with
        softcapped logits, each head's capped scores (compute dtype), its float32 softmax and
        the probabilities in the compute dtype (8 bytes in bf16 and in float32, where the
        last two are one tensor), and the causal mask (1 byte); 0 on flash attention."""
        return 8 * self.heads + 1 if self.softcap else 0

    def act_bytes_layer(self, tokens: int, row: int, compute_bytes: int) -> int:
        """One layer's saved tensors for a micro-batch of ``tokens`` tokens in rows of at most
        ``row`` tokens. The quadratic term is at its bound: the rows' squared lengths sum to at
        most row x tokens, reached when every row is that long; under cp, where ``tokens`` is
        a rank's share and the rank attends whole rows with 1/cp of the heads, the same
        product bounds it."""
        return tokens * self.act_bytes_per_token_layer(compute_bytes) + \
            row * tokens * self.attn_bytes_per_square_token()
