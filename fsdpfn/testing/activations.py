"""What one decoder layer keeps for the backward in the engine's packed forward, measured.

    per_layer, peak = layer_kept_bytes(hf_config, [2048], dtype=torch.bfloat16, device="cuda")

A model of ``hf_config``'s family at two depths runs fsdpfn's packed forward
(fsdpfn.engine.packed.PackedModel with fsdpfn's packed attention; on CUDA, Liger's norm and
SwiGLU kernels swapped in as shard_model swaps them, where installed) on rows of ``lengths``,
under ``torch.autograd.graph.saved_tensors_hooks``. The bytes kept (each storage once, the
weights left out) at the deeper minus the shallower, over the layers between, are one layer's:
what the memory estimate's activation term (fsdpfn.app.recipes.model_shape.ModelShape) is held
against, by tests/unit/test_memory_activations.py, tests/e2e/test_activations_gpu.py and
benchmarks/act_memory.py.
"""

from __future__ import annotations

import copy

import torch

__all__ = ["layer_kept_bytes"]


def _kept(hf_config, layers: int, lengths: list[int], dtype, device) -> tuple[int, int]:
    """(bytes kept for the backward, the device's peak above the start: CUDA only, else 0)."""
    import transformers

    from fsdpfn.engine import attention
    from fsdpfn.engine.packed import PackedModel
    from fsdpfn.wire.kernels import apply_fused_kernels

    cfg = copy.deepcopy(hf_config)
    cfg.num_hidden_layers = layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = (list(cfg.layer_types) * layers)[:layers]
    attention.register()
    cfg._attn_implementation = attention.ATTN_NAME
    torch.manual_seed(0)
    with torch.device(device):
        lm = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    apply_fused_kernels(lm, cfg, torch.device(device).type, keep_weights=True)
    model = PackedModel(lm, is_critic=False)
    model.compute_dtype = dtype
    n = sum(lengths)
    ids = torch.randint(3, cfg.vocab_size, (n,), device=device)
    positions = torch.cat([torch.arange(length, device=device) for length in lengths])
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                      device=device)
    weights = {p.untyped_storage().data_ptr() for p in lm.parameters()}
    kept: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if t.device.type != "meta" and storage.data_ptr() not in weights:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, _ = model(ids, positions, cu, max(lengths), targets=ids.roll(-1), chunk_size=1024)
    if not logp.requires_grad:
        raise RuntimeError("the packed forward kept nothing for a backward")
    logp.float().sum().backward()
    peak = 0
    if cuda:
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - start
    del model, lm, logp
    if cuda:
        torch.cuda.empty_cache()
    return sum(kept.values()), peak


def layer_kept_bytes(hf_config, lengths: list[int], *, dtype=torch.float32, device="cpu",
                     layers: tuple[int, int] = (2, 4)) -> tuple[float, int]:
    """(bytes one decoder layer keeps for the backward on rows of ``lengths``, the device's peak
    during the deeper model's forward and backward above what was allocated before: CUDA only,
    else 0). ``layers``: the two depths measured (a family whose layers alternate kinds needs
    depths that hold whole periods of them)."""
    lo, hi = layers
    (a, _), (b, peak) = (_kept(hf_config, lo, lengths, dtype, device),
                         _kept(hf_config, hi, lengths, dtype, device))
    return (b - a) / (hi - lo), peak
