"""The served model's identity beyond its tensors: the config fields that change what the forward
computes from the same weights, and a stable hash of them.

Two models can share every parameter name, shape and dtype and still compute different
log-probs: a Llama and a Mistral with a sliding window, or two Llamas whose rope_theta differ.
The rollout server reports ``model_type``, ``config_fields`` and ``config_fingerprint`` in
/get_model_info (``fsdpfn.rollout.engine.RolloutEngine.info``); the trainer computes the same
from ``state.hf_config`` and refuses a push whose fingerprint differs, naming the fields
(``fsdpfn.weights.servers.precheck``). Both ends import this one module, so they hash alike.

Only fields a config has are read: a field absent from it is absent from the fingerprint (no
default is filled in that one side could fill differently). Numbers that are whole are written
as integers (``10000`` and ``10000.0`` in two config.json files are one value), and nested
settings are flattened to dotted names (``rope_parameters.rope_theta``), so a refusal names the
exact setting. Pure Python: no torch, no transformers.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

__all__ = ["FINGERPRINT_FIELDS", "config_fields", "config_fingerprint", "diff_config_fields"]

# The config attributes read, when present; each changes the forward for the same weights.
FINGERPRINT_FIELDS = (
    # the family: which modeling code runs
    "model_type",
    # rotary embeddings (transformers 5 keeps rope_theta and the scaling in rope_parameters;
    # earlier versions have rope_theta and rope_scaling as attributes of their own)
    "rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor", "rotary_pct",
    "rotary_emb_base", "rotary_dim", "head_dim", "no_rope_layers", "use_rope",
    # windows and the layers they apply to
    "sliding_window", "layer_types", "use_sliding_window", "max_window_layers",
    "sliding_window_pattern", "attention_chunk_size",
    # norms
    "rms_norm_eps", "layer_norm_eps", "layer_norm_epsilon", "norm_eps", "norm_epsilon",
    "use_qk_norm", "qk_layernorm",
    # softcaps, attention and embedding scales
    "attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar",
    "attention_multiplier", "attention_scale", "embedding_multiplier", "embedding_multiplier_scale",
    "residual_multiplier", "logits_scaling", "output_multiplier_scale", "scale_emb",
    "dim_model_base", "scale_depth", "clip_qkv",
    # activations, heads, biases, tied head
    "hidden_act", "hidden_activation", "num_attention_heads", "num_key_value_heads",
    "attention_bias", "mlp_bias", "tie_word_embeddings",
)

_ABSENT = object()


def _canonical(value: Any) -> Any:
    """``value`` as plain JSON data: whole floats as ints, tuples as lists, dict keys as
    strings; anything else by its repr (so that the hash is defined for any value)."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if math.isfinite(value) and value.is_integer():
            return int(value)
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    return repr(value)


def _flatten(name: str, value: Any, out: dict[str, Any]) -> None:
    """Dicts become dotted names (``rope_parameters.full_attention.rope_theta``)."""
    if isinstance(value, dict) and value:
        for key in sorted(value):
            _flatten(f"{name}.{key}", value[key], out)
    else:
        out[name] = value


def config_fields(hf_config) -> dict[str, Any]:
    """The fingerprinted fields ``hf_config`` has (a transformers config, or a plain dict of
    its fields), canonical and flattened: {dotted name: value}. A model that nests its text
    model's config (``get_text_config()``) is read there, ``model_type`` at the top."""
    def read(cfg, name):
        if isinstance(cfg, dict):
            return cfg.get(name, _ABSENT)
        try:
            return getattr(cfg, name, _ABSENT)
        except Exception:  # noqa: BLE001 - a property that raises is an absent field
            return _ABSENT

    text = hf_config
    get_text = getattr(hf_config, "get_text_config", None)
    if callable(get_text):
        try:
            text = get_text()
        except Exception:  # noqa: BLE001 - no text config: the config itself
            text = hf_config
    out: dict[str, Any] = {}
    seen: set[str] = set()
    for name in FINGERPRINT_FIELDS:
        value = read(hf_config if name == "model_type" else text, name)
        if value is _ABSENT or (name == "rope_scaling" and "rope_parameters" in seen):
            continue  # transformers 5's rope_scaling is another name of rope_parameters
        seen.add(name)
        _flatten(name, _canonical(value), out)
    return out


def config_fingerprint(fields: dict[str, Any]) -> str:
    """sha256 hex of ``fields`` (config_fields' answer) as canonical JSON (keys sorted)."""
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def diff_config_fields(ours: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """The dotted names whose values differ, or that one side has and the other does not,
    sorted with ``model_type`` first."""
    def shown(fields, name):  # JSON, so that True and 1 differ as in the hash
        return json.dumps(fields[name], sort_keys=True) if name in fields else None

    names = {n for n in set(ours) | set(theirs) if shown(ours, n) != shown(theirs, n)}
    return sorted(names, key=lambda n: (n != "model_type", n))
