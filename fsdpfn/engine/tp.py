"""Tensor parallelism of an HF decoder: apply_tp, its plan and the parallel styles it needs.

Embeddings row-parallel over the vocabulary, q/k/v and gate/up column-parallel, o/down
row-parallel, lm_head column-parallel (logits stay split over V). Any vocabulary: rows split like
torch.chunk, no padding row. kv heads that tp does not divide are replicated, each rank computing
the kv heads its query heads use (kv_heads_of_rank); Qwen3's per-head q/k norms are replicated
with their gradients summed over tp. LoRA adapters follow their base linears (fsdpfn.engine.lora.tp_plan).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from fsdpfn.engine import lora
from fsdpfn.engine.mesh import Mesh

__all__ = ["apply_tp", "kv_heads_of_rank", "base_model", "check_tp_plan"]


def base_model(model: nn.Module) -> nn.Module:
    """The decoder stack (embeddings, layers, final norm) of an HF causal or token-class model."""
    return model.base_model


_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def _linear(module) -> bool:
    """A linear, or a LoRA-wrapped one (its base under ``base_layer``)."""
    return isinstance(getattr(module, "base_layer", module), nn.Linear)


def _check_qk_norms(model: nn.Module, attn: nn.Module, tp: int) -> None:
    """q/k norms must be per head (Qwen3's, Gemma-3's: a weight of head_dim): a norm over the
    whole projection (OLMo-2's) takes its statistic across heads that tp splits over ranks."""
    from fsdpfn.errors import ConfigError

    head_dim = getattr(attn, "head_dim", None)
    for name in ("q_norm", "k_norm"):
        weight = getattr(getattr(attn, name, None), "weight", None)
        if weight is not None and head_dim and weight.shape[-1] != head_dim:
            raise ConfigError(f"ParallelStrategy.tp: model_type {model.config.model_type!r} "
                              f"normalises its whole {name[0]} projection across heads "
                              f"(self_attn.{name}, {weight.shape[-1]} wide, head_dim "
                              f"{head_dim}), which the tensor-parallel plan would split over "
                              f"ranks; use tp=1 (dp and cp work), got tp={tp}")


def check_tp_plan(model: nn.Module, tp: int) -> None:
    """ConfigError unless every decoder layer has the projections the plan splits (separate
    q/k/v/o and gate/up/down linears) and per-head q/k norms: a fused projection (Phi-3's
    qkv_proj, gate_up_proj) split column-wise would hand each rank a slice across q, k and v,
    a whole-projection norm (OLMo-2's) would normalise each rank's heads alone; such a model is
    refused under tp rather than computed wrongly."""
    from fsdpfn.errors import ConfigError

    layers = getattr(base_model(model), "layers", None)
    for layer in layers if layers is not None else [None]:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        missing = [f"self_attn.{n}" for n in _ATTN if not _linear(getattr(attn, n, None))]
        missing += [f"mlp.{n}" for n in _MLP if not _linear(getattr(mlp, n, None))]
        if layer is not None and not missing:
            _check_qk_norms(model, attn, tp)
        if layer is None or missing:
            have = sorted({n for n, m in (layer or model).named_modules()
                           if isinstance(m, nn.Linear)})[:6]
            raise ConfigError(f"ParallelStrategy.tp: model_type {model.config.model_type!r} "
                              f"lacks the separate projections the tensor-parallel plan splits "
                              f"({', '.join(missing) or 'decoder layers'}; it has {have}, e.g. "
                              f"fused ones); use tp=1 (dp and cp work), got tp={tp}")


def kv_heads_of_rank(n_heads: int, n_kv_heads: int, tp: int, rank: int) -> list[int]:
    """The kv heads tp rank ``rank`` needs for its query heads [rank*q, (rank+1)*q), q = n_heads
    / tp, when its k/v projections are replicated (n_kv_heads not divisible by tp): the distinct
    heads when every local kv head serves the same number of consecutive query heads (always the
    case when n_kv_heads divides tp: one kv head), else one kv head per query head."""
    q, group = n_heads // tp, n_heads // n_kv_heads
    per_query = [(rank * q + i) // group for i in range(q)]
    distinct = sorted(set(per_query))
    repeat = q // len(distinct)
    if [h for h in distinct for _ in range(repeat)] == per_query:
        return distinct
    return per_query


def _replicated_kv_style(heads: list[int], head_dim: int):
    """k_proj / v_proj kept whole on every tp rank (Replicate); each rank keeps the output
    columns of its ``heads``. The output's gradient is declared Partial over tp, so the weight's
    and the input's gradients are summed over the ranks (each rank saw only its heads)."""
    from torch.distributed.tensor import Partial, distribute_module
    from torch.distributed.tensor.parallel import ColwiseParallel

    index = torch.tensor(heads, dtype=torch.long)

    class ReplicatedKV(ColwiseParallel):
        def _partition_linear_fn(self, name, module, device_mesh):
            _replicate_params(module, device_mesh, self.src_data_rank)

        @staticmethod
        def _select_heads(module, outputs, device_mesh):
            local = outputs.to_local(grad_placements=[Partial()])  # (..., n_kv * D)
            by_head = local.unflatten(-1, (-1, head_dim))  # (..., n_kv, D)
            picked = by_head.index_select(-2, index.to(local.device))
            return picked.flatten(-2)  # (..., len(heads) * D)

        def _apply(self, module, device_mesh):
            return distribute_module(
                module, device_mesh, self._partition_linear_fn,
                functools.partial(self._prepare_input_fn, self.input_layouts,
                                  self.desired_input_layouts),
                self._select_heads)

    return ReplicatedKV()


def _replicate_params(module: nn.Module, device_mesh, src_data_rank) -> None:
    """Each of ``module``'s own parameters made whole (Replicate) on every tp rank."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    for pname, param in module.named_parameters(recurse=False):
        whole = distribute_tensor(param, device_mesh, [Replicate()], src_data_rank=src_data_rank)
        module.register_parameter(pname, nn.Parameter(whole, requires_grad=param.requires_grad))


def _per_head_norm_style():
    """A norm over head_dim applied to each head (Qwen3's q_norm / k_norm): its weight is
    replicated over tp while each rank normalises only its heads, so the input is declared
    Shard over the heads dim and the weight's gradient comes out Partial, summed over tp."""
    from torch.distributed.tensor import DTensor, Shard, distribute_module
    from torch.distributed.tensor.parallel.style import ParallelStyle

    class PerHeadNorm(ParallelStyle):
        def _partition(self, name, module, device_mesh):
            _replicate_params(module, device_mesh, self.src_data_rank)

        @staticmethod
        def _heads_input(module, inputs, device_mesh):
            x = inputs[0]  # (..., heads of this rank, D)
            return DTensor.from_local(x, device_mesh, [Shard(x.ndim - 2)], run_check=False)

        @staticmethod
        def _local_output(module, outputs, device_mesh):
            return outputs.to_local()

        def _apply(self, module, device_mesh):
            return distribute_module(module, device_mesh, self._partition, self._heads_input,
                                     self._local_output)

    return PerHeadNorm()


def _attention_plan(layer: nn.Module, n_heads: int, n_kv_heads: int, tp_mesh) -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel()}
    for name in ("q_norm", "k_norm"):  # per-head norms (Qwen3): replicated, grads summed
        norm = getattr(layer.self_attn, name, None)
        if norm is not None and any(True for _ in norm.parameters()):
            plan[f"self_attn.{name}"] = _per_head_norm_style()
    if n_kv_heads % tp_mesh.size() == 0:
        plan.update({"self_attn.k_proj": ColwiseParallel(), "self_attn.v_proj": ColwiseParallel()})
        return plan
    attn = layer.self_attn
    head_dim = getattr(attn, "head_dim", None) or attn.k_proj.out_features // n_kv_heads
    heads = kv_heads_of_rank(n_heads, n_kv_heads, tp_mesh.size(), tp_mesh.get_local_rank())
    plan["self_attn.k_proj"] = _replicated_kv_style(heads, head_dim)
    plan["self_attn.v_proj"] = _replicated_kv_style(heads, head_dim)
    # HF's eager GQA reads this ratio; fsdpfn's attention reads the shapes (the same ratio)
    attn.num_key_value_groups = (n_heads // tp_mesh.size()) // len(heads)
    return plan


def apply_tp(model: nn.Module, mesh: Mesh) -> None:
    """Tensor parallel plan: embeddings row-parallel (over the vocabulary), q/k/v and gate/up
    column-parallel, o/down row-parallel, lm_head column-parallel (logits stay split over V).

    Any vocabulary: the rows split like torch.chunk (ceil(V / tp) per rank, the last ranks
    shorter), so no padding row exists in a parameter, a logit, a checkpoint or an export. kv
    heads not divisible by tp: k/v projections replicated, each rank computing the kv heads its
    query heads use (see kv_heads_of_rank)."""
    if mesh.tp == 1:
        return
    check_tp_plan(model, mesh.tp)
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    tp_mesh = mesh.device_mesh["tp"]
    base = base_model(model)
    config = model.config
    n_heads = config.num_attention_heads
    n_kv_heads = getattr(config, "num_key_value_heads", None) or n_heads
    head = model.get_output_embeddings()
    embed = base.get_input_embeddings()
    tied = getattr(config, "tie_word_embeddings", False) and head is not None
    parallelize_module(embed, tp_mesh,
                       RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
    for layer in base.layers:
        plan = {**_attention_plan(layer, n_heads, n_kv_heads, tp_mesh),
                "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel()}
        parallelize_module(layer, tp_mesh, lora.tp_plan(layer, plan))
    if head is not None:
        parallelize_module(head, tp_mesh,
                           ColwiseParallel(output_layouts=Shard(-1), use_local_output=False))
        if tied:  # one parameter, sharded over V in both roles
            head.weight = embed.weight
