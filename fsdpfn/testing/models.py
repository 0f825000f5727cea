"""Tiny model configs built locally (nothing downloaded), and a helper that saves one to disk."""

from __future__ import annotations

from pathlib import Path

import torch

from fsdpfn import keys as K

__all__ = ["tiny_qwen2_config", "tiny_llama_config", "tiny_qwen3_config", "save_tiny_model",
           "sharded_logits", "tiny_family_configs", "FAMILY_WINDOW", "hf_config_of",
           "save_family_model", "hf_reference_logp", "hf_reference_update", "full_model_state",
           "assert_update_matches", "engine_update", "compiled_blocks"]


def _common(overrides: dict) -> dict:
    base = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                tie_word_embeddings=False, rms_norm_eps=1e-6)
    base.update(overrides)
    return base


def tiny_qwen2_config(**overrides):
    """A 2-layer Qwen2 (GQA 4:2 heads, q/k/v biases, vocab 128), about 60k parameters."""
    from transformers import Qwen2Config

    return Qwen2Config(**_common(overrides))


def tiny_llama_config(**overrides):
    """A 2-layer Llama (GQA 4:2 heads, no biases, vocab 128)."""
    from transformers import LlamaConfig

    return LlamaConfig(**_common(overrides))


def tiny_qwen3_config(**overrides):
    """A 2-layer Qwen3 (q/k norms, head_dim 16)."""
    from transformers import Qwen3Config

    return Qwen3Config(**_common({"head_dim": 16, **overrides}))


# the sliding window of the tiny family configs: shorter than their test rows (40-64 tokens)
FAMILY_WINDOW = 12


def _family_specs() -> dict[str, dict]:
    """model_type and overrides of each tiny family variant (3 layers, odd vocabulary 131)."""
    w = FAMILY_WINDOW
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    gemma2 = dict(head_dim=16, query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                  final_logit_softcapping=3.0, sliding_window=w, hidden_activation="gelu_pytorch_tanh",
                  layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    return {
        "llama": dict(model_type="llama"),
        "llama-rope-llama3": dict(model_type="llama", rope_scaling=llama3),
        "llama-rope-linear": dict(model_type="llama",
                                  rope_scaling={"rope_type": "linear", "factor": 2.0}),
        # dynamic NTK rescales once positions pass max_position_embeddings (rows reach 64)
        "llama-rope-dynamic": dict(model_type="llama", max_position_embeddings=32,
                                   rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
        "llama-rope-yarn": dict(model_type="llama", max_position_embeddings=64,
                                rope_scaling=yarn),
        "qwen2": dict(model_type="qwen2"),
        "qwen2-sliding": dict(model_type="qwen2", use_sliding_window=True, sliding_window=w,
                              max_window_layers=1),
        "qwen3": dict(model_type="qwen3", head_dim=16),
        "mistral": dict(model_type="mistral", head_dim=16, sliding_window=w),
        "gemma": dict(model_type="gemma", head_dim=16, tie_word_embeddings=True),
        "gemma2": dict(model_type="gemma2", tie_word_embeddings=True, **gemma2),
        "gemma3_text": dict(model_type="gemma3_text", head_dim=16, query_pre_attn_scalar=20,
                            sliding_window=w, tie_word_embeddings=True,
                            layer_types=["sliding_attention", "sliding_attention",
                                         "full_attention"],
                            rope_parameters={
                                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                   "rope_theta": 1e6}}),
        "phi3": dict(model_type="phi3", pad_token_id=0, bos_token_id=1, eos_token_id=2),
        "olmo2": dict(model_type="olmo2", pad_token_id=0, eos_token_id=2),
    }


def tiny_family_configs() -> dict[str, dict]:
    """name -> a tiny model config dict (``EngineConfig.model_config``) of every verified family
    and variant: 3 layers, GQA 4:2 heads, vocabulary 131, windows of FAMILY_WINDOW tokens."""
    return {name: _common({"vocab_size": 131, "num_hidden_layers": 3, **spec})
            for name, spec in _family_specs().items()}


def save_tiny_model(path: str | Path, config, *, seed: int = 0, critic: bool = False) -> Path:
    """Build ``config`` with random init under ``seed`` and save it as a HF safetensors directory."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    torch.manual_seed(seed)
    if critic:
        config.num_labels = 1
        model = AutoModelForTokenClassification.from_config(config, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = Path(path)
    model.save_pretrained(path, safe_serialization=True)
    return path


def hf_config_of(spec: dict):
    """A transformers config from a model_config dict (``{"model_type": ..., **fields}``)."""
    from transformers import AutoConfig

    spec = dict(spec)
    return AutoConfig.for_model(spec.pop("model_type"), **spec)


def save_family_model(path: str | Path, spec: dict, *, seed: int = 0, noise: float = 0.05) -> Path:
    """A tiny causal LM of ``spec`` saved as an HF directory, every parameter perturbed by
    N(0, noise²) after HF's init, so norm weights, norm offsets and biases matter."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config_of(spec), dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * noise)
    model.save_pretrained(Path(path), safe_serialization=True)
    return Path(path)


def hf_reference_logp(model, input_ids: torch.Tensor, attention_mask: torch.Tensor):
    """The model's own forward on the right-padded batch: logp[B, T] float32 of token t given
    the tokens before it (0 at t = 0 and on padding), and the logits [B, T, V]."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask.long(),
                   use_cache=False).logits.float()
    logp = torch.log_softmax(logits[:, :-1], -1).gather(-1, input_ids[:, 1:, None])[..., 0]
    logp = torch.cat([torch.zeros_like(logp[:, :1]), logp], dim=1)
    return torch.where(attention_mask.bool(), logp, torch.zeros(())), logits


# the OptimizerConfig fields under which an engine's sft_step makes hf_reference_update's step
REFERENCE_STEP = dict(lr=1.0, eps=1.0, betas=(0.0, 0.0), weight_decay=0.0, max_grad_norm=None)


def hf_reference_update(model_dir: str, batch):
    """The model's own eager float32 forward and one sign-like step on ``batch`` (input_ids,
    attention_mask, loss_mask): (logp[B, T], the mean NLL over loss_mask, the update
    -g / (|g| + 1) of every parameter by name): what an sft_step with Adam at lr 1, eps 1, no
    betas and no decay (REFERENCE_STEP) must do."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="eager")
    logp, _ = hf_reference_logp(model, batch[K.INPUT_IDS], batch[K.ATTENTION_MASK])
    mask = batch[K.LOSS_MASK]
    nll = -(logp * mask).sum() / mask.sum()
    nll.backward()
    deltas = {n: -p.grad / (p.grad.abs() + 1.0) for n, p in model.named_parameters()}
    return logp.detach(), float(nll.detach()), deltas


def assert_update_matches(label: str, got: tuple, want: tuple) -> None:
    """(logp, loss, deltas) of an engine against hf_reference_update's: log-probs and loss to
    1e-5, each parameter's update to rtol 1e-4 / atol 5e-6."""
    (logp, loss, deltas), (ref_logp, ref_nll, ref_deltas) = got, want
    gap = float((logp - ref_logp).abs().max())
    assert gap <= 1e-5, f"{label}: logp gap {gap:.3g}"
    assert abs(loss - ref_nll) <= 1e-5, f"{label}: loss {loss} against {ref_nll}"
    for name, expected in ref_deltas.items():
        torch.testing.assert_close(deltas[name], expected, rtol=1e-4, atol=5e-6,
                                   msg=lambda m, name=name: f"{label} {name}: {m}")


def engine_update(state, batch, mesh):
    """forward_logp of ``batch``, then one sft_step (every rank calls it): (logp[B, T], the
    step's loss, each parameter's update by HF name) on rank 0, None elsewhere; the pieces
    assert_update_matches takes."""
    import torch.distributed as dist

    import fsdpfn as ff

    local = ff.shard_batch(batch, mesh)
    logp = ff.gather_batch(ff.forward_logp(state, local), mesh)[K.LOGP]
    before = full_model_state(state)
    state, stats = ff.sft_step(state, local)
    after = full_model_state(state)
    if dist.get_rank() != 0:
        return None
    return logp, float(stats["loss"]), {k: after[k] - before[k] for k in after}


def full_model_state(state) -> dict:
    """The HF-named full weights of a sharded state, on the CPU (every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    sd = get_model_state_dict(state.model, options=StateDictOptions(full_state_dict=True,
                                                                    cpu_offload=True))
    return {k[len("lm."):]: v.clone() for k, v in sd.items()}


def compiled_blocks(state) -> int:
    """How many of a state's modules run a torch.compile'd forward (EngineConfig.compile
    replaces each decoder block's forward with one carrying its compiled function)."""
    return sum(hasattr(getattr(m.__dict__.get("forward"), "compiled", None),
                       "_torchdynamo_orig_callable") for m in state.model.modules())


@torch.no_grad()
def sharded_logits(state, input_ids: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary logits [B, T, V] of a sharded actor state, for tests (every rank calls it).

    Runs each row through the FSDP root as one packed sequence and gathers vocabulary-split
    logits; the [B, T, V] tensor is what fsdpfn's own paths avoid, so keep the inputs small.
    """
    device = state.mesh.device
    rows = []
    for ids in input_ids.to(device):
        T = ids.shape[0]
        cu = torch.tensor([0, T], dtype=torch.int32)
        logits = state.model(ids, torch.arange(T, device=device), cu, T, full_logits=True)
        rows.append(logits.float().cpu())
    return torch.stack(rows)


# for each family, the earliest transformers release checked to compute it exactly on the packed
# path (5.0, 5.17 and 5.25 were checked; releases between two checked ones were not): on 5.0
# Falcon and Nemotron pick attention classes of their own and StableLM fails on a pack, on 5.17
# Falcon still picks its own, and the guard refuses each by name. GPT-J, CodeGen and CTRL: the
# first release whose modeling routes their attention through AttentionInterface (read from
# each release's source); on 5.0 each is refused by name, on 5.25 each is exact
EXACT_SINCE = {"stablelm": "5.17", "nemotron": "5.17", "falcon": "5.25", "gptj": "5.24",
               "codegen": "5.24", "ctrl": "5.14"}


def exact_here(model_type: str) -> bool:
    """Whether the installed transformers is one in which ``model_type`` (a key of EXACT_SINCE)
    computes exactly on the packed path; otherwise shard_model refuses it by name."""
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__).release >= Version(EXACT_SINCE[model_type]).release
