"""grad_step: the one place that runs forward, backward, gradient clipping and optimizer steps.

The call's minibatches are cut from the global batch (fsdpfn.engine.minibatch), so that the
update does not depend on how rows are spread over data-parallel ranks.

For each minibatch:
  1. count the normaliser over the whole minibatch on every data-parallel rank (all-reduced):
     tokens (Σ loss_mask), sequences (rows with a loss token), rows, or pairs;
  2. for each micro-batch (token budget, count agreed over ranks): packed forward, then
     ``loss_fn(outputs, minibatch, ctx) -> (loss_sum, stats)`` on the padded view of its rows,
     backward of loss_sum / normaliser. FSDP sums gradients (its averaging is off), so the
     gradient is that of Σ loss / global count: independent of how rows are spread over ranks and
     micro-batches;
  3. one global gradient norm over all shards (tp-aware), clipping, and a vote: a non-finite norm
     skips the optimizer step on every rank, leaving weights and optimizer state untouched.

``loss_fn`` receives ``outputs`` (a TensorDict [b, T] of this micro-batch's rows: ``logp`` and,
when asked, ``entropy`` for actors; ``values`` and ``scores`` for critics), ``minibatch`` (the same
rows of the input batch) and ``ctx`` (StepContext). It returns a 0-dim loss *sum* and a dict of
0-dim stats, also sums: the engine divides them by the same normaliser and sums them over
micro-batches and ranks (keys ending in ``_max`` are reduced by max instead).
"""

from __future__ import annotations

import math
from typing import Callable, Mapping, Sequence

import attrs
import torch
import torch.distributed as dist
from tensordict import TensorDict

from fsdpfn import keys as K
from fsdpfn.agree import same_on_every_rank, verdict, world_size
from fsdpfn.batch import pack, select_rows, unpack
from fsdpfn.config import MicroBatchSpec
from fsdpfn.engine import timing
from fsdpfn.errors import ConfigError, MicroBatchOOMError
from fsdpfn.validators import is_nonempty_str
from fsdpfn.engine.mesh import Mesh
from fsdpfn.engine.minibatch import as_order, denominator, global_counts, minibatches
from fsdpfn.engine.objective import NORMALIZERS, Objective, as_objective, check_actor_options
from fsdpfn.engine.runner import (empty_packed, model_outputs, oom_error, plan, prepare,
                                  release_memory, resolve_mb_spec, rope_top)
from fsdpfn.engine.state import EngineState, advance, check_live, record_own_writes

__all__ = ["grad_step", "evaluate", "StepContext", "global_grad_norm", "NORMALIZERS"]


@attrs.frozen
class StepContext:
    """What a loss function may need beyond its micro-batch (all counts are global)."""

    mesh: Mesh
    step: int                  # optimizer steps taken before this minibatch
    minibatch: int             # index of this minibatch within the call
    n_minibatches: int
    n_tokens: int              # Σ loss_mask over the minibatch, all data-parallel ranks
    n_sequences: int           # rows with at least one loss token, all ranks
    n_rows: int                # rows, all ranks
    normalizer: str
    denominator: float         # what loss_sum is divided by


def _is_dtensor(t) -> bool:
    return hasattr(t, "_local_tensor") and hasattr(t, "placements")


def global_grad_norm(model: torch.nn.Module, mesh: Mesh) -> torch.Tensor:
    """L2 norm of all gradients of the sharded model, identical on every rank.

    Each rank sums the squares of its local shards, dividing by how many ranks hold the same
    shard (replicas over mesh axes a parameter is not sharded on), then one all-reduce over the
    world: correct for FSDP, TP and 2D parameters alike, with no cross-mesh stacking.
    """
    world = world_size()
    total = torch.zeros((), dtype=torch.float32, device=mesh.device)
    for param in model.parameters():
        grad = param.grad
        if grad is None:
            continue
        if _is_dtensor(grad):
            # _StridedShard (FSDP over a tp-sharded dim) does not answer is_shard(): count every
            # placement that is neither replicated nor partial as a split of the tensor
            shards = math.prod(grad.device_mesh.size(i) for i, p in enumerate(grad.placements)
                               if not (p.is_replicate() or p.is_partial()))
            local = grad._local_tensor  # noqa: SLF001
        else:
            shards, local = 1, grad
        total += local.float().pow(2).sum().to(total.device) / (world // shards)
    if world > 1:
        dist.all_reduce(total)
    return total.sqrt()


def _clip_(model: torch.nn.Module, coef: torch.Tensor) -> None:
    grads = [p.grad._local_tensor if _is_dtensor(p.grad) else p.grad  # noqa: SLF001
             for p in model.parameters() if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].device))


def _outputs(state: EngineState, packed, *, with_entropy: bool, temperature: float) -> TensorDict:
    """Model outputs of one packed micro-batch, as the padded [S, T] view of its rows."""
    S, T = packed.n_seqs, packed.T
    packed = packed.to(state.mesh.device)
    if state.config.is_critic:
        values, scores = model_outputs(state, packed)
        data = {K.VALUES: unpack(packed, values, compact=True),
                "scores": unpack(packed, scores, compact=True)}
    else:
        logp, entropy = model_outputs(state, packed, temperature=temperature,
                                      with_entropy=with_entropy)
        data = {K.LOGP: unpack(packed, logp, compact=True)}
        if with_entropy:
            data[K.ENTROPY] = unpack(packed, entropy, compact=True)
    return TensorDict(data, batch_size=[S, T], device=state.mesh.device)


def _dummy_loss(state, packed, with_entropy, temperature) -> torch.Tensor:
    """Zero loss through the whole model: an empty micro-batch still joins every collective."""
    out = model_outputs(state, packed, temperature=temperature, with_entropy=with_entropy)
    first = out[0]
    loss = first.sum() * 0.0
    if not state.config.is_critic and with_entropy:
        loss = loss + out[1].sum() * 0.0
    return loss


class _LossFnFailed(Exception):
    """loss_fn, or what it returned, failed on this rank; the pass joined its peers' collectives
    first (a zero backward), and the minibatch's verdict hands the error to every rank."""

    def __init__(self, error: Exception):
        super().__init__(str(error))
        self.error = error


def _agree_on_stats(sums: dict, maxes: dict, failure: Exception | None, fn_name: str) -> None:
    """Every rank's verdict on the minibatch before its stats are reduced by name: a loss_fn
    that failed on any rank raises on every rank, and the ranks that ran a loss_fn must report
    the same stat names (a rank without rows takes the others' names, counting 0 or -inf).
    One all-reduce of three int64 over the job (fsdpfn.agree.verdict)."""
    named = bool(sums or maxes)
    every = verdict(failure, (sorted(sums), sorted(maxes)) if named else None, foreign=lambda
                    where, tname, message: RuntimeError(
                        f"{fn_name}: loss_fn failed on rank {where} ({tname}: {message}); every "
                        f"rank stops with it, before any optimizer step of this minibatch"))
    if every is None:
        return
    given = {r: n for r, n in enumerate(every) if n is not None}
    if len({repr(n) for n in given.values()}) > 1:
        shown = "; ".join(f"rank {r}: {sorted(set(n[0]) | set(n[1]))}" for r, n in given.items())
        raise ConfigError(f"loss_fn: must return the same stat names on every rank (stats are "
                          f"reduced by name over the ranks), got {shown}")
    if not named and given:
        sums_names, max_names = next(iter(given.values()))
        sums.update({name: torch.zeros(()) for name in sums_names})
        maxes.update({name: torch.tensor(float("-inf")) for name in max_names})


def _reduce_stats(sums: dict[str, torch.Tensor], maxes: dict[str, torch.Tensor], denom: float,
                  state: EngineState, *, failure: Exception | None = None,
                  fn_name: str = "grad_step") -> dict[str, float]:
    """Sums (divided by ``denom``) and maxes over the data-parallel ranks, after the ranks'
    verdict (_agree_on_stats)."""
    _agree_on_stats(sums, maxes, failure, fn_name)
    names = sorted(sums)
    out: dict[str, float] = {}
    if names:
        vec = torch.stack([sums[n].cpu() for n in names]).double()
        if state.mesh.dp > 1:
            dist.all_reduce(vec, group=state.mesh.group("dp"))
        out.update({n: float(v) / denom for n, v in zip(names, vec.tolist())})
    names = sorted(maxes)
    if names:
        vec = torch.stack([maxes[n].cpu() for n in names]).double()
        if state.mesh.dp > 1:
            dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=state.mesh.group("dp"))
        out.update(dict(zip(names, vec.tolist())))
    return out


def _micro_step(state: EngineState, mb, rows, packed, loss_fn, ctx: StepContext, *,
                with_entropy: bool, temperature: float, backward: bool) -> dict:
    """Forward (and backward) of one micro-batch; its stats as 0-dim tensors (loss first). A
    loss_fn that fails (or returns what grad_step cannot use) raises _LossFnFailed after a zero
    backward, so that this rank's peers are not left waiting in the backward's collectives."""
    timing.enter("forward")
    outputs = _outputs(state, packed, with_entropy=with_entropy, temperature=temperature)
    try:
        loss_sum, stats = _call_loss_fn(loss_fn, outputs, select_rows(mb, rows).to(
            state.mesh.device), ctx, backward)
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - user code: handed to every rank by the verdict
        if backward:
            timing.enter("backward")
            zero = sum(t.sum() for t in outputs.values() if t.requires_grad)
            if isinstance(zero, torch.Tensor):
                (zero * 0.0).backward()
        raise _LossFnFailed(exc) from exc
    if backward:
        timing.enter("backward")
        (loss_sum / ctx.denominator).backward()
    return stats


def _call_loss_fn(loss_fn, outputs, minibatch, ctx: StepContext, backward: bool):
    """``loss_fn``'s (loss_sum, stats as 0-dim float tensors, loss first), checked."""
    returned = loss_fn(outputs, minibatch, ctx)
    if not isinstance(returned, tuple) or len(returned) != 2:
        raise ConfigError(f"loss_fn: must return a pair (loss_sum, stats), got "
                          f"{_short(returned)}")
    loss_sum, stats = returned
    if (not isinstance(loss_sum, torch.Tensor) or loss_sum.ndim != 0
            or not loss_sum.is_floating_point()):
        raise ConfigError(f"loss_fn: must return a 0-dim floating-point tensor loss sum, got "
                          f"{_short(loss_sum)}")
    if not isinstance(stats, Mapping):
        raise ConfigError(f"loss_fn: must return its stats as a dict of name -> 0-dim value, got "
                          f"{_short(stats)}")
    if backward and not loss_sum.requires_grad:
        raise ConfigError("loss_fn: the loss sum must be computed from the outputs (it has no "
                          f"gradient: detached, or built under no_grad), got {_short(loss_sum)}")
    return loss_sum, {"loss": loss_sum.detach().float(), **{
        name: _stat(name, value) for name, value in dict(stats).items()}}


# the names of the stats the engine reports itself: a loss_fn's stat of one of them would
# replace the engine's, or be replaced by it
ENGINE_STATS = ("loss", "grad_norm", "lr", "tokens", "skipped", "steps")


def _stat(name, value) -> torch.Tensor:
    """One of loss_fn's stats as a 0-dim float tensor; a ConfigError naming it otherwise."""
    if not is_nonempty_str(name):
        raise ConfigError(f"loss_fn: stat names must be non-empty strings, got {_short(name)}")
    if name in ENGINE_STATS:
        raise ConfigError(f"loss_fn: stat {name!r} is one the engine reports itself "
                          f"({', '.join(ENGINE_STATS)}); name it otherwise, got {name!r}")
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    scalar = isinstance(value, torch.Tensor) and value.ndim == 0 and not value.is_complex()
    if not (number or scalar):
        raise ConfigError(f"loss_fn: stat {name!r} must be a number or a 0-dim tensor, got "
                          f"{_short(value)}")
    return torch.as_tensor(value).detach().float().reshape(())


def _short(value, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({type(value).__name__})"


def _run_minibatch(state: EngineState, mb, loss_fn, ctx_fields: dict, *, normalizer: str,
                   group_size: int, with_entropy: bool, temperature: float,
                   backward: bool, spec: MicroBatchSpec,
                   fn_name: str) -> tuple[dict[str, float], int]:
    """Forward (and backward) every micro-batch of one minibatch; returns (stats, n_tokens).

    A device out-of-memory error in a micro-batch becomes MicroBatchOOMError, raised after the
    failed pass's tensors are gone (outside the except block), gradients dropped and cached
    memory released: no optimizer step has run, so the state is unchanged.
    """
    timing.enter("comm")
    n_tokens, n_seqs, n_rows = global_counts(state, mb)
    timing.enter("plan")
    denom = denominator(normalizer, n_tokens, n_seqs, n_rows)
    ctx = StepContext(mesh=state.mesh, n_tokens=n_tokens, n_sequences=n_seqs, n_rows=n_rows,
                      normalizer=normalizer, denominator=denom, **ctx_fields)
    sums: dict[str, torch.Tensor] = {}
    maxes: dict[str, torch.Tensor] = {}
    failed, failure = None, None
    for rows in plan(state, mb, group_size=group_size, mb_spec=spec):
        if not rows:
            if backward:
                timing.enter("backward")
                _dummy_loss(state, empty_packed(mb), with_entropy, temperature).backward()
            continue
        timing.enter("plan")
        packed = pack(mb, rows=rows)
        if failure is not None:  # after a failed loss_fn: the peers' passes, joined with zeros
            zero = _dummy_loss(state, packed, with_entropy, temperature)
            if backward:
                timing.enter("backward")
                zero.backward()
            continue
        try:
            stats = _micro_step(state, mb, rows, packed, loss_fn, ctx, with_entropy=with_entropy,
                                temperature=temperature, backward=backward)
        except torch.OutOfMemoryError:
            failed = packed.n_tokens
            break
        except _LossFnFailed as exc:
            failure = exc.error
            continue
        for name, value in stats.items():
            if name.endswith("_max"):
                maxes[name] = torch.maximum(maxes[name], value) if name in maxes else value
            else:
                sums[name] = sums.get(name, torch.zeros((), device=value.device)) + value
    if failed is not None:
        release_memory(state)
        raise oom_error(state, fn_name, failed, spec)
    timing.enter("comm")
    return _reduce_stats(sums, maxes, denom, state, failure=failure, fn_name=fn_name), n_tokens


def _check_common(state, optimizer_steps, fn_name, needs_optimizer, obj: Objective) -> None:
    if not isinstance(optimizer_steps, int) or isinstance(optimizer_steps, bool) \
            or optimizer_steps < 1:
        raise ConfigError(f"optimizer_steps: must be an integer >= 1, got {optimizer_steps!r}")
    critic = obj.critic
    if isinstance(state, EngineState) and state.config.is_critic:
        check_actor_options(obj, "the state is a critic (EngineConfig(is_critic=True))")
    if critic is not None and isinstance(state, EngineState) \
            and bool(state.config.is_critic) != critic:
        raise ConfigError(f"{fn_name}: needs a {'critic' if critic else 'policy'} state "
                          f"(EngineConfig(is_critic={critic})), got is_critic="
                          f"{state.config.is_critic}")
    if needs_optimizer and isinstance(state, EngineState) and state.optimizer is None:
        raise ConfigError(f"{fn_name}: needs a trainable state, got one built with "
                          f"optimizer=None (inference only)")


@timing.timed("grad_step", passes=3, attach=True, step=True)
def grad_step(state: EngineState, batch, loss_fn: Callable | Objective, *,
              optimizer_steps: int = 1, order: Sequence[int] | None = None,
              shuffle_seed: int | None = None,
              mb_spec: MicroBatchSpec | None = None) -> tuple[EngineState, TensorDict]:
    """Forward, backward, clip and ``optimizer_steps`` optimizer steps; see the module docstring.

    ``loss_fn`` is an Objective (fsdpfn.engine.objective: the loss and its options in one value)
    or a bare ``loss_fn(outputs, minibatch, ctx) -> (loss_sum, stats)``, run as an Objective with
    the default options. ``order``: the order of the global batch's units (rows, or the Objective's
    groups) its minibatches are cut from, the same on every rank (None: as given);
    ``shuffle_seed``: instead, a permutation drawn from this seed (both without effect on one
    minibatch, which is every row).

    Returns ``(new_state, stats)``; ``state`` is donated. Stats (identical on all ranks; each the
    mean over the call's minibatches, keys ending in ``_max`` their max): the loss_fn's keys,
    ``loss``, ``grad_norm``, ``lr``; and over the call ``tokens``, ``skipped`` (optimizer steps
    skipped for a non-finite gradient norm) and ``steps`` (optimizer steps taken); with
    ``EngineConfig.timing`` also ``time_plan``, ``time_forward``, ``time_backward``,
    ``time_optimizer``, ``time_comm``, ``time_total`` (seconds), ``peak_memory_gb``,
    ``tokens_per_s`` and ``mfu`` (when a peak rate is known): see fsdpfn.engine.timing.
    ``mb_spec`` overrides ``state.config.mb_spec`` for this call. A micro-batch that runs out of
    device memory raises MicroBatchOOMError with gradients dropped and memory released:
    ``state`` is then not donated and can be retried, e.g. with a smaller ``mb_spec``; only when
    earlier minibatches of the call (optimizer_steps > 1) already stepped is it donated, its
    successor being the error's ``.state``; so it is for any other error raised after a step
    (a ``loss_fn`` failing on a later minibatch). A ``loss_fn`` that fails on some ranks only
    raises on every rank (the failing ranks join their peers' passes with zero losses first),
    and a call whose batch keys, options or config differ by rank is one error on every rank.
    """
    error, spec, obj = None, None, None
    try:
        obj = as_objective(loss_fn)
        _check_common(state, optimizer_steps, obj.name, True, obj)
        order = as_order(order, shuffle_seed)
        spec = resolve_mb_spec(state, mb_spec) if isinstance(state, EngineState) else None
    except ConfigError as exc:
        error = exc
    fn_name = obj.name if obj is not None else "grad_step"
    check_live(state, fn_name, local_error=error)
    loss_fn, group_size = obj.loss_fn, obj.unit
    prepare(state, batch, fn_name, require=obj.require, why=obj.why,
            group_size=obj.group_size if obj.group_size > 1 else None, pairs=obj.pairs)
    _same_call(fn_name, batch, obj, optimizer_steps=optimizer_steps, order=order,
               shuffle_seed=shuffle_seed, mb_spec=spec)
    # batch tensors are data: one with an autograd graph (advantages computed without no_grad)
    # is read as its values, so no backward runs into the caller's graph
    batch = batch.detach()
    model, optimizer, scheduler = state.model, state.optimizer, state.scheduler
    max_norm = state.config.optimizer.max_grad_norm
    model.train()
    parts = minibatches(state, batch, optimizer_steps, group_size=group_size, order=order,
                         shuffle_seed=shuffle_seed, fn_name=fn_name)
    per_step: list[dict[str, float]] = []
    taken = skipped = tokens = 0
    with rope_top(state, batch):  # one rotary length for the whole call
        for index, mb in enumerate(parts):
            optimizer.zero_grad(set_to_none=True)
            lr = scheduler.get_last_lr()[0]
            try:
                stats, n_tok = _run_minibatch(
                    state, mb, loss_fn,
                    dict(step=state.step + taken, minibatch=index, n_minibatches=optimizer_steps),
                    normalizer=obj.normalizer, group_size=group_size, with_entropy=obj.with_entropy,
                    temperature=obj.temperature, backward=True, spec=spec, fn_name=fn_name)
            except Exception as exc:
                optimizer.zero_grad(set_to_none=True)
                if not taken:
                    raise
                if isinstance(exc, MicroBatchOOMError):
                    raise _oom_after_steps(state, fn_name, exc, spec, taken) from None
                exc.state = advance(state, fn_name, steps=taken, weights_changed=True)
                exc.add_note(f"{fn_name}: {taken} optimizer step(s) of this call had run before "
                             f"this error (minibatch {index} of {optimizer_steps}): the state "
                             "passed in is donated, and the error's .state is its successor")
                raise
            timing.enter("optimizer")
            norm = global_grad_norm(model, state.mesh)
            finite = bool(torch.isfinite(norm).item())  # same value on every rank: one verdict
            if finite:
                if max_norm is not None:
                    _clip_(model, torch.clamp(max_norm / (norm + 1e-6), max=1.0))
                optimizer.step()
                scheduler.step()
                record_own_writes(state)  # the next minibatch's plan checks only outside writes
                taken += 1
            else:
                skipped += 1
            optimizer.zero_grad(set_to_none=True)
            tokens += n_tok
            per_step.append({**stats, "grad_norm": float(norm), "lr": lr})
    out = _overminibatches(per_step)
    out.update(tokens=float(tokens), skipped=float(skipped), steps=float(taken))
    successor = advance(state, fn_name, steps=taken, weights_changed=taken > 0)
    return successor, TensorDict({k: torch.tensor(v, dtype=torch.float32)
                                  for k, v in out.items()}, batch_size=[])


def _same_call(fn_name: str, batch, obj: Objective, **options) -> None:
    """The same call on every rank: the batch's keys (BatchError), the call's options and the
    Objective's, its config field by field (ConfigError naming each that differs)."""
    values = {"batch keys": sorted(str(k) for k in batch.keys()), **options,
              "Objective.require": sorted(obj.require),  # a set's order is the process's own
              **{f"Objective.{name}": getattr(obj, name) for name in (
                  "normalizer", "group_size", "pairs", "with_entropy", "temperature", "critic")}}
    config = obj.config
    if config is not None and attrs.has(type(config)):
        values.update({f"{type(config).__name__}.{f.name}": getattr(config, f.name)
                       for f in attrs.fields(type(config)) if f.eq})
    same_on_every_rank(fn_name, values, batch_names=("batch keys",))


def _overminibatches(per_step: list[dict[str, float]]) -> dict[str, float]:
    """A call's stats: each key's mean over the minibatches that report it (a loss_fn may vary
    its keys), the max for keys ending in ``_max``."""
    out = {}
    for name in dict.fromkeys(k for stats in per_step for k in stats):
        values = [stats[name] for stats in per_step if name in stats]
        out[name] = max(values) if name.endswith("_max") else sum(values) / len(values)
    return out


def _oom_after_steps(state: EngineState, fn_name: str, exc: MicroBatchOOMError,
                     spec: MicroBatchSpec, taken: int) -> MicroBatchOOMError:
    """An out-of-memory error after earlier minibatches of the call stepped: the weights did
    change, so the state is advanced and its successor rides on the error as ``.state``."""
    error = oom_error(state, fn_name, exc.n_tokens, spec, stepped=taken)
    error.state = advance(state, fn_name, steps=taken, weights_changed=True)
    return error


@timing.timed("evaluate", passes=1, attach=True)
@torch.no_grad()
def evaluate(state: EngineState, batch, loss_fn: Callable | Objective, *,
             mb_spec: MicroBatchSpec | None = None) -> TensorDict:
    """The stats grad_step would report for ``batch`` (an Objective, or a bare loss_fn run with
    the default options), without changing the state (``mb_spec`` overrides the state's
    micro-batching for this call)."""
    error, spec, obj = None, None, None
    try:
        obj = as_objective(loss_fn, "evaluate")
        _check_common(state, 1, "evaluate", False, obj)
        spec = resolve_mb_spec(state, mb_spec) if isinstance(state, EngineState) else None
    except ConfigError as exc:
        error = exc
    check_live(state, "evaluate", local_error=error)
    group_size = obj.unit
    prepare(state, batch, "evaluate", require=obj.require, why=obj.why,
            group_size=obj.group_size if obj.group_size > 1 else None, pairs=obj.pairs)
    _same_call("evaluate", batch, obj, mb_spec=spec)
    was_training = state.model.training
    state.model.eval()
    try:
        with rope_top(state, batch):
            stats, n_tok = _run_minibatch(
                state, batch, obj.loss_fn, dict(step=state.step, minibatch=0, n_minibatches=1),
                normalizer=obj.normalizer, group_size=group_size, with_entropy=obj.with_entropy,
                temperature=obj.temperature, backward=False, spec=spec, fn_name="evaluate")
    finally:
        state.model.train(was_training)
    stats["tokens"] = float(n_tok)
    return TensorDict({k: torch.tensor(v, dtype=torch.float32) for k, v in stats.items()},
                      batch_size=[])
