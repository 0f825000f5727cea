"""Which model families the engine computes exactly, what it refuses, and the guard for the rest.

The engine does not run a model's own forward: it packs sequences into one row, runs its own
attention over them and computes log-probs from the last hidden states with its own head. That is
exact for a family only when these re-implemented pieces do what the family's modules do
(windows, softcaps, scales, biases, norm offsets, buffers). So:

- ``VERIFIED`` families are tested, variant by variant, against the model's own float32 forward
  (tests/unit/test_families.py); see docs/models.md for what is verified for each.
- What cannot be built or checked is refused by ``model_type`` before any weight moves
  (``refusal``): mixture-of-experts, models needing inputs the batch contract lacks (multimodal,
  encoder-decoder), heads that scale their logits, bidirectional attention.
- Any other family is checked when it is built (``verify_architecture``, per
  ``EngineConfig.verify_model``): a small random instance of the same architecture (the same
  modeling classes, layer pattern, attention options and head; windows shortened so the probe
  passes them) runs the engine's packed forward and the model's own eager forward on two rows of
  different lengths, in float32 on the rank's device. A gap above ``VERIFY_TOL`` refuses the
  model with a ConfigError naming the family, the gap and the verified list.
"""

from __future__ import annotations

import logging

import torch

from fsdpfn.errors import ConfigError

__all__ = ["VERIFIED", "TP_VERIFIED", "CRITIC_VERIFIED", "VERIFY_TOL", "refusal", "check_refusals",
           "verify_architecture", "check_model", "check_structure", "probe_config"]

log = logging.getLogger("fsdpfn")

# model_type -> what is exact for it (docs/models.md has the table)
VERIFIED = ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3_text", "phi3",
            "olmo2")
# of those, the families the tensor-parallel plan splits (Phi-3's fused projections and OLMo-2's
# whole-projection q/k norms are refused under tp by fsdpfn.engine.tp.check_tp_plan)
TP_VERIFIED = tuple(f for f in VERIFIED if f not in ("phi3", "olmo2"))
# of those, the families with a token-classification class (a critic: rw's reward model, ppo's
# value model), tested against its own head (tests/unit/test_families_critic.py)
CRITIC_VERIFIED = tuple(f for f in VERIFIED if f not in ("gemma3_text", "olmo2"))

# log-prob gap (nats) above which the guard refuses: float32 paths of a tiny model agree to
# about 1e-6; an ignored window, softcap, scale or bias moves log-probs by 1e-2 or more
VERIFY_TOL = 1e-4

_EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_MOE_HINTS = ("moe", "mixtral", "dbrx", "jamba", "deepseek_v2", "deepseek_v3", "llama4",
              "gpt_oss", "minimax", "arctic", "jetmoe")
_MULTIMODAL_FIELDS = ("vision_config", "audio_config", "speech_config", "vision_tower",
                      "text_config")
_LOGIT_SCALES = ("logit_scale", "logits_scaling", "output_multiplier_scale")
# families whose attention adds ALiBi's per-head position biases to its scores
_ALIBI_TYPES = ("bloom", "mpt")
# recurrent and state-space families (whole models, or layers beside attention)
_RECURRENT_TYPES = ("mamba", "mamba2", "falcon_mamba", "rwkv", "recurrent_gemma", "bamba",
                    "zamba", "zamba2", "falcon_h1", "xlstm", "nemotron_h", "lfm2_vl")
# layer types the packed attention computes
_ATTENTION_LAYERS = ("full_attention", "sliding_attention", "attention")


def _experts(hf_config) -> int:
    return max((int(getattr(hf_config, f, 0) or 0) for f in _EXPERT_FIELDS), default=0)


def refusal(hf_config, *, is_critic: bool = False) -> str | None:
    """Why the engine cannot compute ``hf_config``'s model exactly (None: it can try)."""
    model_type = hf_config.model_type
    if _experts(hf_config) > 0 or any(h in model_type for h in _MOE_HINTS):
        return ("a mixture-of-experts model: expert routing, its load-balancing loss and "
                "expert parallelism are not implemented")
    if getattr(hf_config, "is_encoder_decoder", False):
        return "an encoder-decoder model: the batch contract holds decoder-only token rows"
    present = [f for f in _MULTIMODAL_FIELDS if getattr(hf_config, f, None) is not None]
    if present:
        return (f"a multimodal or composite model ({', '.join(present)}): the batch contract "
                f"holds text token rows only; use its text-only model_type if it has one")
    if getattr(hf_config, "use_bidirectional_attention", False):
        return "bidirectional attention: the packed attention is causal"
    attn_config = getattr(hf_config, "attn_config", None)
    if model_type in _ALIBI_TYPES or getattr(hf_config, "alibi", False) \
            or getattr(attn_config, "alibi", False):
        return ("ALiBi position biases: the packed attention adds no per-head bias to its "
                "scores")
    layers = [t for t in (getattr(hf_config, "layer_types", None) or [])
              if isinstance(t, str) and t not in _ATTENTION_LAYERS]
    if model_type in _RECURRENT_TYPES:
        return "a recurrent or state-space model: the engine packs attention layers only"
    if layers:
        return (f"layers that are not attention (layer types {sorted(set(layers))}): the "
                f"engine packs attention layers only")
    for name in _LOGIT_SCALES:
        value = getattr(hf_config, name, None)
        if value is not None and float(value) != 1.0:
            return (f"its head scales the logits ({name}={value}), which the engine's "
                    f"log-prob head does not apply")
    if not _has_class(hf_config, is_critic):
        kind = "token-classification (critic)" if is_critic else "causal-LM"
        return f"transformers has no {kind} class for it"
    return None


def _has_class(hf_config, is_critic: bool) -> bool:
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    auto = AutoModelForTokenClassification if is_critic else AutoModelForCausalLM
    return type(hf_config) in auto._model_mapping  # noqa: SLF001 - transformers' own registry


def check_refusals(hf_config, *, is_critic: bool = False) -> None:
    """ConfigError naming the model_type and the reason, for a model the engine refuses."""
    why = refusal(hf_config, is_critic=is_critic)
    if why is not None and is_critic and refusal(hf_config) is None:  # a causal LM, not a critic
        raise ConfigError(f"model_type: {hf_config.model_type!r} is not supported as a critic "
                          f"(rw's reward model, ppo's value model): {why} (families verified "
                          f"as critics: {', '.join(CRITIC_VERIFIED)})")
    if why is not None:
        raise ConfigError(f"model_type: {hf_config.model_type!r} is not supported: {why} "
                          f"(verified families: {', '.join(VERIFIED)})")


def check_structure(lm, *, model_type: str, is_critic: bool, lora: bool) -> None:
    """What the engine reads by name from the built (meta) model, present: a critic's value head
    ``score`` and, for LoRA, the decoder layers at ``model.layers``. ConfigError otherwise, the
    same on every rank (every rank builds the same skeleton), before any weight moves."""
    if is_critic and not hasattr(lm, "score"):
        heads = [n for n, _ in lm.named_children() if n != lm.base_model_prefix]
        raise ConfigError(f"is_critic: model_type {model_type!r} names its token-classification "
                          f"head {heads}, not 'score', which the engine's value head reads; "
                          f"this family is not supported as a critic (rw's reward model, "
                          f"ppo's value model; families verified as critics: "
                          f"{', '.join(CRITIC_VERIFIED)})")
    if lora and not hasattr(getattr(lm, "model", None), "layers"):
        raise ConfigError(f"lora: model_type {model_type!r} keeps its decoder layers elsewhere "
                          f"than model.layers, where LoRA's targets are found; this family is "
                          f"not supported with LoRA")


# ---------------------------------------------------------------- the guard


_PROBE_LENGTHS = (24, 17)
_PROBE_WINDOW = 8


def probe_config(hf_config):
    """A small config of the same architecture: 64 wide, 4 heads (GQA kept), vocabulary 131,
    as many layers as it takes to hold each layer type once (at most 6), windows of 8 tokens."""
    from transformers import AutoConfig

    spec = hf_config.to_dict()
    heads = spec.get("num_attention_heads") or 4
    kv = spec.get("num_key_value_heads") or heads
    types = list(spec.get("layer_types") or [])
    n_layers = min(spec.get("num_hidden_layers") or 2, 6)
    if types:
        n_layers = min(max(2, max(types.index(t) for t in set(types)) + 1), len(types))
        spec["layer_types"] = types[:n_layers]
    width = spec.get("hidden_size") or 64
    head = spec.get("head_dim") or width // heads
    spec.update(num_hidden_layers=n_layers, hidden_size=64, intermediate_size=128,
                num_attention_heads=4, num_key_value_heads=2 if kv < heads else 4,
                vocab_size=131)
    if "num_kv_heads" in spec:  # Falcon's name of it, beside the mapped one
        spec["num_kv_heads"] = spec["num_key_value_heads"]
    if spec.get("head_dim") is not None:
        spec["head_dim"] = 16
    if spec.get("rotary_dim"):  # GPT-J, CodeGen: the rotary share of each head, kept
        share = int(spec["rotary_dim"]) / max(int(head), 1)
        spec["rotary_dim"] = max(2, min(16, 2 * round(16 * share / 2)))
    if "max_window_layers" in spec:
        spec["max_window_layers"] = min(int(spec["max_window_layers"] or 0), n_layers - 1)
    if spec.get("sliding_window"):
        spec["sliding_window"] = min(int(spec["sliding_window"]), _PROBE_WINDOW)
    for key, value in list(spec.items()):  # per-layer tables cut to the layers kept
        if isinstance(value, dict) and value and all(_layer_index(k) is not None for k in value):
            spec[key] = {k: v for k, v in value.items() if _layer_index(k) < n_layers}
    for i, key in enumerate(("pad_token_id", "bos_token_id", "eos_token_id")):
        # ids within the probe's vocabulary (some configs refuse None for them): 130, 129, 128
        value = spec.get(key)
        if isinstance(value, int) and value >= 131:
            spec[key] = 130 - i
        elif isinstance(value, list):
            spec[key] = [t if not isinstance(t, int) or t < 131 else 130 - i for t in value]
    for key in ("architectures", "transformers_version", "_name_or_path", "torch_dtype", "dtype"):
        spec.pop(key, None)
    model_type = spec.pop("model_type")
    return AutoConfig.for_model(model_type, **spec)


def _layer_index(key) -> int | None:
    """A per-layer table's key as a layer index (gemma4's per_layer_config: '05'), else None."""
    if isinstance(key, bool):
        return None
    if isinstance(key, int):
        return key
    return int(key) if isinstance(key, str) and key.isdigit() else None


def _probe_models(small, *, is_critic: bool, device, fused_kernels: bool):
    """(reference, engine): the same random weights (perturbed, so norm weights, offsets and
    biases matter), the reference computing with HF's eager attention, the engine's with fsdpfn's
    packed attention and, when ``fused_kernels``, the fused kernels the engine swaps in."""
    import copy

    from fsdpfn.engine import cp
    from fsdpfn.engine.load_weights import build_skeleton, restore_buffers
    from fsdpfn.engine.packed import PackedModel
    from fsdpfn.wire.kernels import apply_fused_kernels

    gen = torch.Generator().manual_seed(0)
    small._attn_implementation = "eager"
    ref = build_skeleton(small, is_critic=is_critic, dtype=torch.float32, device="cpu")
    with torch.no_grad():
        for param in ref.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.1)
    ref = ref.to(device).eval()
    # the engine's copy is built as shard_model builds: on meta, materialised, weights copied
    # in, non-persistent buffers recomputed, fused kernels swapped in
    packed_config = copy.deepcopy(small)
    cp.register()
    packed_config._attn_implementation = cp.attn_name(1)
    lm = build_skeleton(packed_config, is_critic=is_critic, dtype=torch.float32, device="meta")
    lm.to_empty(device=device)
    lm.load_state_dict(ref.state_dict(), strict=False)
    restore_buffers(lm, packed_config, is_critic=is_critic, dtype=torch.float32, device=device)
    if fused_kernels:
        apply_fused_kernels(lm, packed_config, torch.device(device).type, keep_weights=True)
    engine = PackedModel(lm, is_critic=is_critic).eval()
    engine.compute_dtype = torch.float32
    return ref, engine


def _probe_rows(device):
    """Two rows of _PROBE_LENGTHS tokens: padded ids and mask [2, T] for the model's own forward,
    and the packed ids, positions, cu_seqlens and next-token targets [N] for the engine's."""
    gen = torch.Generator().manual_seed(1)
    T = max(_PROBE_LENGTHS)
    ids = torch.randint(3, 131, (len(_PROBE_LENGTHS), T), generator=gen).to(device)
    mask = (torch.arange(T)[None] < torch.tensor(_PROBE_LENGTHS)[:, None]).to(device)
    packed = torch.cat([ids[b, :n] for b, n in enumerate(_PROBE_LENGTHS)])
    positions = torch.cat([torch.arange(n, device=device) for n in _PROBE_LENGTHS])
    cu = torch.tensor([0, *torch.tensor(_PROBE_LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    targets = torch.cat([torch.cat([ids[b, 1:n], ids.new_zeros(1)])
                         for b, n in enumerate(_PROBE_LENGTHS)])
    return ids, mask, (packed, positions, cu, T), targets


def attention_table_error(model_type: str, exc: KeyError) -> ConfigError | None:
    """The ConfigError for a KeyError raised where a family's modeling code looks the engine's
    attention up in a table of its own (transformers' Falcon and GPT-J before 5.25 and 5.24),
    instead of through transformers' AttentionInterface; None for any other KeyError."""
    if not (exc.args and str(exc.args[0]).startswith("fsdpfn_")):  # our registered names
        return None
    import transformers

    return ConfigError(
        f"model_type: {model_type!r} is not supported with transformers "
        f"{transformers.__version__}: its modeling code picks its attention from a table of "
        f"its own (no entry {exc.args[0]!r}), not through transformers' AttentionInterface, "
        f"which the engine's packed attention plugs into (a later transformers may route it "
        f"there); verified families: {', '.join(VERIFIED)}")


@torch.no_grad()
def verify_architecture(hf_config, *, is_critic: bool = False, device="cpu",
                        fused_kernels: bool = False) -> float:
    """The largest gap (log-probs, or values for a critic) between the engine's packed forward
    and the model's own eager forward on a small instance of ``hf_config``'s architecture.
    The caller's random state is left as it was."""
    with torch.random.fork_rng(devices=[]):
        ref, engine = _probe_models(probe_config(hf_config), is_critic=is_critic,
                                    device=device, fused_kernels=fused_kernels)
    ids, mask, packed, targets = _probe_rows(device)
    own = ref(input_ids=ids, attention_mask=mask.long()).logits.float()  # (2, T, V or 1)
    cu = packed[2]
    if is_critic:
        got = engine(*packed)  # values [N]
        want = [own[b, :n, 0] for b, n in enumerate(_PROBE_LENGTHS)]
    else:  # log-probs of each row's next tokens (its last position predicts nothing)
        got, _ = engine(*packed, targets)
        want = [torch.log_softmax(own[b, :n - 1], -1).gather(-1, ids[b, 1:n, None])[:, 0]
                for b, n in enumerate(_PROBE_LENGTHS)]
    gaps = [(got[int(cu[b]):int(cu[b]) + len(w)] - w).abs().max() for b, w in enumerate(want)]
    return float(torch.stack(gaps).max())


def _wants_check(verify_model: str, model_type: str) -> bool:
    return verify_model == "always" or (verify_model == "unverified"
                                        and model_type not in VERIFIED)


def check_model(hf_config, *, verify_model: str, is_critic: bool, device,
                fused_kernels: bool, tp: int = 1) -> float | None:
    """Refusals, then (per ``verify_model``) the guard; returns the measured gap, or None when
    the guard did not run. Raises ConfigError naming the model_type and the reason or the gap.
    Every rank runs the same probe (same seeds), so every rank reaches the same verdict.

    The guard's probe runs the packed forward at tp=1: a family outside VERIFIED (whose tp=2
    forward the tests compare with the model's own) is refused under ``tp`` > 1 unless
    ``verify_model`` is 'never'. Its own modules may compute across the width tp splits (a
    sub-norm over a projection, a weight scale over a whole matrix, paired heads): refused by
    name rather than computed wrongly or failing inside a step."""
    check_refusals(hf_config, is_critic=is_critic)
    model_type = hf_config.model_type
    if tp > 1 and verify_model != "never" and model_type not in VERIFIED:
        raise ConfigError(f"ParallelStrategy.tp: model_type {model_type!r} is outside the "
                          f"verified families, and the guard checks its forward at tp=1 only; "
                          f"tensor parallelism is verified for {', '.join(TP_VERIFIED)}; use "
                          f"tp=1 (dp and cp work), or "
                          f"EngineConfig.verify_model='never' to run it at your own risk, got "
                          f"tp={tp}")
    if not _wants_check(verify_model, model_type):
        return None
    if is_critic:  # a critic head the engine cannot read is refused by check_structure
        from transformers import AutoModelForTokenClassification

        with torch.device("meta"):
            check_structure(AutoModelForTokenClassification.from_config(hf_config),
                            model_type=model_type, is_critic=True, lora=False)
    try:
        gap = verify_architecture(hf_config, is_critic=is_critic, device=device,
                                  fused_kernels=fused_kernels)
    except ConfigError:
        raise
    except KeyError as exc:
        own_table = attention_table_error(model_type, exc)
        if own_table is not None:
            raise own_table from None
        raise ConfigError(f"model_type: {model_type!r} could not be checked against its own "
                          f"forward (KeyError: {exc}); verified families: "
                          f"{', '.join(VERIFIED)} (EngineConfig.verify_model='never' skips "
                          f"the check at your own risk)") from None
    except Exception as exc:  # noqa: BLE001 - any failure of an unknown architecture refuses it
        raise ConfigError(f"model_type: {model_type!r} could not be checked against its own "
                          f"forward ({type(exc).__name__}: {exc}); verified families: "
                          f"{', '.join(VERIFIED)} (EngineConfig.verify_model='never' skips "
                          f"the check at your own risk)") from None
    if not gap <= VERIFY_TOL:
        raise ConfigError(f"model_type: {model_type!r} is not computed exactly by the engine: "
                          f"its packed forward differs from the model's own forward by {gap:.3g} "
                          f"(tolerance {VERIFY_TOL:g}) on a probe of its architecture; verified "
                          f"families: {', '.join(VERIFIED)} (EngineConfig.verify_model='never' "
                          f"skips the check at your own risk)")
    log.info("model_type %r is outside the verified families; its architecture was checked "
             "against its own forward (gap %.2g <= %g)", model_type, gap, VERIFY_TOL)
    return gap
