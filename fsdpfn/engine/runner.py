"""The micro-batch runner shared by the forwards (fsdpfn.engine.forward) and the steps (fsdpfn.engine.step).

prepare (lease and batch checks, agreed on every rank) -> plan (micro-batches by token budget, the
count agreed over all ranks) -> pack each, or empty_packed where a rank has none -> model_outputs
(PackedModel on one micro-batch, token-aligned results). An out-of-memory error becomes
oom_error's MicroBatchOOMError after release_memory.
"""

from __future__ import annotations

import contextlib
import zlib
from typing import Sequence

import torch
import torch.distributed as dist
from tensordict import TensorDict

from fsdpfn import keys as K
from fsdpfn.batch import (Packed, next_token_targets, plan_microbatches, row_lengths,
                          shift_to_token_aligned, validate_batch)
from fsdpfn.config import DEFAULT_MAX_TOKENS_PER_MB, MicroBatchSpec
from fsdpfn.errors import BatchError, ConfigError, MicroBatchOOMError
from fsdpfn.agree import require_loss_tokens, world_size
from fsdpfn.engine.state import EngineState, check_live
from fsdpfn.wire import checksum

__all__ = ["prepare", "plan", "model_outputs", "empty_packed", "resolve_mb_spec",
           "release_memory", "oom_error"]


def _tensor_keys(batch) -> list:
    return sorted((k for k in batch.keys(include_nested=True, leaves_only=True)
                   if isinstance(batch.get(k), torch.Tensor)), key=str)


def _key_hashes(batch, keys, device) -> torch.Tensor:
    """The content checksum (fsdpfn.wire.checksum) of each key's bytes, int64 [len(keys)],
    computed on ``device`` (the mesh's: a GPU hashes a CPU batch faster than the host)."""
    return checksum.tensor_hashes([batch.get(k).detach().to(device) for k in keys])


def _batch_fingerprint(batch, device) -> torch.Tensor:
    """Every tensor of ``batch`` (each key's name, dtype, shape and bytes) as three int64s: the
    content checksums of the keys in name order, combined (a change, a swap, a negation of any
    value of any key changes it: masks, advantages, log-probs as well as the token ids), a CRC
    of the keys' names, dtypes and shapes, and the number of keys. On input_ids' device."""
    keys = _tensor_keys(batch)
    layout = ";".join(f"{k}:{batch.get(k).dtype}:{list(batch.get(k).shape)}" for k in keys)
    hashes = _key_hashes(batch, keys, device)
    content = checksum.combine(hashes, torch.arange(1, len(keys) + 1, device=hashes.device))
    return torch.tensor([int(content), zlib.crc32(layout.encode()), len(keys)],
                        dtype=torch.int64, device=batch.get(K.INPUT_IDS).device)


def _differing_keys(batch, gathered: list[torch.Tensor], group, device) -> str:
    """Which keys differ over ``group``, for the message: the keys' own checksums compared when
    every rank has the same keys, dtypes and shapes (every rank of the group takes the same
    branch: the fingerprints it reads were gathered), else that the layouts differ."""
    if any(not torch.equal(g[1:], gathered[0][1:]) for g in gathered):
        return "their keys, dtypes or shapes differ"
    keys = _tensor_keys(batch)
    mine = _key_hashes(batch, keys, device).to(gathered[0].device)
    every = [torch.zeros_like(mine) for _ in gathered]
    dist.all_gather(every, mine, group=group)
    differ = [str(k) for i, k in enumerate(keys) if any(h[i] != every[0][i] for h in every)]
    return f"the values of {differ} differ"


def _check_replicas(state: EngineState, batch) -> BatchError | None:
    """Ranks that differ only in their tp (or cp) coordinate must pass identical rows: every
    key's bytes, compared by _batch_fingerprint."""
    mesh, error, fp = state.mesh, None, None
    for axis, what in (("tp", "tensor-parallel"), ("cp", "context-parallel")):
        size = getattr(mesh, axis)
        if size == 1:
            continue
        if fp is None:  # once for both axes: it hashes every byte of the batch
            fp = _batch_fingerprint(batch, mesh.device)
        gathered = [torch.zeros_like(fp) for _ in range(size)]
        dist.all_gather(gathered, fp, group=mesh.group(axis))  # every axis: no rank left waiting
        if any(not torch.equal(g, gathered[0]) for g in gathered):
            which = _differing_keys(batch, gathered, mesh.group(axis), mesh.device)
            error = error or BatchError(
                f"batch: ranks of one {what} group must pass identical rows (every key, "
                f"byte for byte), got different batches on its {size} {axis} ranks: {which}")
    return error


def prepare(state: EngineState, batch, fn_name: str, *, require: Sequence[str] = (),
            why: dict | None = None, group_size: int | None = None, pairs: bool = False,
            critic: bool | None = None) -> None:
    """Check the state's lease and the batch on every rank; all ranks raise if any rank fails.
    A batch whose loss_mask is required must have a loss token in the global batch, not on
    every rank (a dp rank's rows may all be untrained)."""
    error = None
    mesh = state.mesh if isinstance(state, EngineState) else None
    global_tokens = K.LOSS_MASK in require and mesh is not None and mesh.dp > 1
    try:
        if critic is not None and isinstance(state, EngineState) and \
                state.config.is_critic != critic:
            kind = "a critic (is_critic=True)" if critic else "an actor (is_critic=False)"
            raise ConfigError(f"{fn_name}: needs {kind} state, got is_critic="
                              f"{state.config.is_critic}")
        if not isinstance(batch, TensorDict):
            raise BatchError(f"batch: must be a tensordict.TensorDict, got {type(batch).__name__}")
        vocab = state.hf_config.vocab_size if isinstance(state, EngineState) else None
        validate_batch(batch, require=require, vocab_size=vocab, group_size=group_size,
                       pairs=pairs, why=why, nonempty=False if global_tokens else None)
    except (BatchError, ConfigError) as exc:
        error = exc
    check_live(state, fn_name, local_error=error)
    check_live(state, fn_name, local_error=_check_replicas(state, batch))
    if global_tokens:
        require_loss_tokens(mesh, batch.get(K.LOSS_MASK))


def resolve_mb_spec(state: EngineState, mb_spec) -> MicroBatchSpec:
    """The micro-batching of one call: ``mb_spec`` when given, else the state's config."""
    if mb_spec is None:
        return state.config.mb_spec
    if not isinstance(mb_spec, MicroBatchSpec):
        raise ConfigError(f"mb_spec: must be a MicroBatchSpec or None, got {mb_spec!r}")
    return mb_spec


def release_memory(state: EngineState) -> None:
    """After an out-of-memory error: drop gradients, reshard FSDP parameters left gathered by
    the interrupted pass, and hand cached device memory back."""
    for param in state.model.parameters():
        param.grad = None
    for module in state.model.modules():
        reshard = getattr(module, "reshard", None)
        if callable(reshard) and type(module).__name__.startswith("FSDP"):
            try:
                reshard()
            except Exception:  # noqa: BLE001 - best effort: a module already resharded is fine
                pass
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def oom_error(state: EngineState, fn_name: str, n_tokens: int, spec: MicroBatchSpec, *,
              stepped: int = 0) -> MicroBatchOOMError:
    """The typed error for a micro-batch of ``n_tokens`` that ran out of device memory;
    ``stepped``: optimizer steps the call had already taken (then the state was advanced)."""
    budget = spec.max_tokens_per_mb
    smaller = max(1, min(n_tokens, budget or DEFAULT_MAX_TOKENS_PER_MB) // 2)
    shown = budget if budget is not None else f"None (automatic, {DEFAULT_MAX_TOKENS_PER_MB})"
    if stepped:
        what = (f"{stepped} earlier optimizer step(s) of this call did run: continue from the "
                f"error's .state (the successor of the state passed)")
    else:
        what = "nothing was updated, so the same state can be used again"
    return MicroBatchOOMError(
        f"{fn_name}: out of device memory on a micro-batch of {n_tokens} tokens "
        f"(max_tokens_per_mb={shown}, n_mbs={spec.n_mbs}). Gradients were dropped and cached "
        f"memory released; {what}. Lower EngineConfig.mb_spec.max_tokens_per_mb, or retry the "
        f"call with mb_spec=MicroBatchSpec(max_tokens_per_mb={smaller}).{device_memory_note()}",
        fn_name=fn_name, n_tokens=n_tokens, max_tokens_per_mb=budget)


def device_memory_note() -> str:
    """Where the GPU's memory is, for an out-of-memory error: what this process holds against
    what the rest of the device does (another process on the same GPU, such as a rollout
    server's KV cache, is a cause no micro-batch budget fixes). Empty without CUDA."""
    if not torch.cuda.is_available():
        return ""
    try:
        free, total = torch.cuda.mem_get_info()
    except RuntimeError:  # no device context to ask
        return ""
    return memory_note(free=free, total=total, held=torch.cuda.memory_reserved())


def memory_note(*, free: int, total: int, held: int) -> str:
    """The sentence of device_memory_note for a device of ``total`` bytes with ``free`` bytes
    free, of which this process's allocator holds ``held``."""
    gib = 2 ** 30
    rest = max(0, total - free - held)
    note = (f" Device memory: {total / gib:.1f} GiB in all, {held / gib:.1f} GiB held by this "
            f"process, {rest / gib:.1f} GiB outside it, {free / gib:.1f} GiB free")
    if rest > total // 4:
        note += (" (another process on this GPU holds most of that: a rollout server sizes its "
                 "KV cache with --decode-rows)")
    return note + "."


def budget_kwargs(spec: MicroBatchSpec) -> dict:
    """plan_microbatches' budget keywords for ``spec``: max_tokens_per_mb=None is the automatic
    budget (DEFAULT_MAX_TOKENS_PER_MB, soft: a longer row or group goes alone); an explicit
    budget is a limit (a longer one is a BatchError)."""
    if spec.max_tokens_per_mb is not None:
        return {"max_tokens_per_mb": spec.max_tokens_per_mb}
    return {"max_tokens_per_mb": DEFAULT_MAX_TOKENS_PER_MB, "strict": False}


def plan(state: EngineState, batch, *, group_size: int = 1,
         mb_spec: MicroBatchSpec | None = None) -> list[list[int]]:
    """Micro-batches (row lists) of this rank; the count is the max over all ranks."""
    spec = mb_spec if mb_spec is not None else state.config.mb_spec
    budget = budget_kwargs(spec)
    lens = row_lengths(batch)
    error, rows = None, []
    try:
        rows = plan_microbatches(lens, **budget, n_mbs=spec.n_mbs, group_size=group_size,
                                 algo=spec.algo, cp=state.mesh.cp)
    except BatchError as exc:
        error = exc
    check_live(state, "plan", local_error=error)
    count = torch.tensor([len(rows)], dtype=torch.int64)
    if world_size() > 1:
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
    if int(count.item()) > len(rows):
        rows = plan_microbatches(lens, **budget, n_mbs=spec.n_mbs, group_size=group_size,
                                 algo=spec.algo, min_n_mbs=int(count.item()), cp=state.mesh.cp)
    return rows


def rope_top(state: EngineState, batch):
    """Context for one call over ``batch`` (this rank's rows): a model whose rotary frequencies
    follow the highest position (dynamic NTK, longrope) rotates every micro-batch with the
    batch's padded width T, the largest over every rank (one MAX all-reduce), as the model's own
    forward on the padded batch does (its positions run to T - 1 in every row): its numbers do
    not depend on the micro-batches or the dp split. Other models: nothing to do."""
    from fsdpfn.engine.packed import batch_rope_top

    if not getattr(state.model, "length_dependent_rope", False):
        return contextlib.nullcontext()
    top = torch.tensor([batch.get(K.ATTENTION_MASK).shape[1] - 1], dtype=torch.int64)
    if world_size() > 1:
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
    return batch_rope_top(int(top.item()))


def empty_packed(batch) -> Packed:
    """A one-token stand-in for an empty micro-batch: every rank must run the same collectives."""
    T = batch.get(K.INPUT_IDS).shape[1]
    zero = torch.zeros(1, dtype=torch.int64)
    return Packed(input_ids=zero, position_ids=zero, cu_seqlens=torch.tensor([0, 1], dtype=torch.int32),
                  seq_lens=(1,), rows=torch.zeros(0, dtype=torch.int64), seq_ids=zero,
                  token_index=zero, max_seqlen=1, T=T, B=batch.batch_size[0])


def model_outputs(state: EngineState, packed: Packed, *, temperature: float = 1.0,
                  with_entropy: bool = False):
    """Run PackedModel on one micro-batch; token-aligned [N] results.

    Actor: (logp[N], entropy[N] or None), 0 at each sequence's first token. Critic: (values[N],
    scores[N]): scores[i] is the head's output at token i (what a reward model reads at a row's
    last token); values are token aligned like logp, values[t] = scores[t-1] (the value of the
    prefix before token t), 0 at each sequence's first token.
    """
    device = state.mesh.device
    packed = packed.to(device)
    ids, pos = packed.input_ids, packed.position_ids
    if state.config.is_critic:
        scores = state.model(ids, pos, packed.cu_seqlens, packed.max_seqlen).float()
        return shift_to_token_aligned(packed, scores), scores
    targets, _ = next_token_targets(packed)
    logp, entropy = state.model(ids, pos, packed.cu_seqlens, packed.max_seqlen, targets,
                                temperature=temperature, with_entropy=with_entropy,
                                chunk_size=state.config.logprobs_chunk_size)
    logp = shift_to_token_aligned(packed, logp.float())
    if entropy is not None:
        entropy = shift_to_token_aligned(packed, entropy.float())
    return logp, entropy
