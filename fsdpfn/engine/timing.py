"""Where a call's time and memory go: stage times, peak memory, tokens/s and MFU per call.

A timed call (grad_step and the algorithms built on it, evaluate, forward_logp, compute_values)
runs under a ``Clock``. The engine marks where each stage begins (``enter("forward")``); the
time from one mark to the next is charged to the stage entered, so the stages partition the
call and never overlap:

    plan       validating the batch, planning micro-batches, packing and unpacking them
    forward    the packed forward and the loss function
    backward   backward (and an empty micro-batch's stand-in pass)
    optimizer  gradient norm, clipping, optimizer and scheduler step
    comm       the engine's own blocking collectives (global token counts, stats reductions):
               mostly waiting for the slowest rank. FSDP's all-gathers and reduce-scatters
               overlap forward and backward and are counted there (a trace tells them apart)

On CUDA each mark records an event on the current stream (no host synchronisation); the call
reads them all after one synchronisation at its end, so a stage's time is the device timeline
between its marks (including the device waiting for the host). On CPU a mark reads
``time.perf_counter``. ``time_total`` is the host wall time of the whole call; the stages add up
to at most that (the rest: the final synchronisation and bookkeeping).

Numbers are made identical on all ranks by one all-gather at the end of the call: stage times
and ``time_total`` are the slowest rank's (so they still add up), ``peak_memory_gb`` the largest
over ranks, tokens the sum over data-parallel ranks.

MFU (model FLOPs utilisation, the convention of BENCHMARKS.md):

    flops = passes · (2 · P · tokens + 2 · L · d · Σ len²)
    mfu   = flops / (time_total · world_size · peak_tflops · 1e12)

P: the model's matmul parameters (every parameter of two or more dimensions, the lm_head
counted, the embedding lookup not), tokens: real (unpadded) tokens of the call over all
data-parallel ranks, len: each row's real length, L: layers, d: query heads · head size (the
width attention runs at, the hidden size unless the config sets head_dim otherwise; causal
attention: 2·len²·d per layer forward), passes: 3 for a training step (forward + backward), 1 for
a forward. Activation-checkpointing recompute is not counted (the usual MFU, not HFU).
peak_tflops: ``EngineConfig.peak_tflops``, else measured once per process and device by an
8192³ GEMM in the compute dtype (``measure_peak_tflops``); on CPU there is no MFU unless given.

Forward-only calls return the caller's batch and cannot carry stats; their numbers (and a
training step's) are kept per model: ``last_timings(state)``.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import resource
import sys
import time
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist

from fsdpfn.agree import world_size
from fsdpfn.engine.state import EngineState
from fsdpfn.errors import ConfigError

__all__ = ["STAGES", "KEYS", "Clock", "enter", "region", "timed", "last_timings",
           "measure_peak_tflops", "peak_tflops", "matmul_params", "model_flops"]

STAGES = ("plan", "forward", "backward", "optimizer", "comm")
# every stats key timing may add (measurements: they differ from run to run and layout to layout)
KEYS = frozenset({*(f"time_{s}" for s in STAGES), "time_total", "peak_memory_gb",
                  "tokens_per_s", "mfu"})

# the clock of the timed call running in this context (None outside one): set and reset by
# ``timed`` around a single call, so the engine's internal functions keep their signatures
_CLOCK: contextvars.ContextVar["Clock | None"] = contextvars.ContextVar("fsdpfn_clock",
                                                                       default=None)
# the fsdpfn.profile session this context runs under (fsdpfn.engine.profiling sets and resets it)
PROFILER: contextvars.ContextVar[Any] = contextvars.ContextVar("fsdpfn_profiler", default=None)

# model -> {function name -> numbers of its last timed call}; dropped with the model
_LAST: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


class Clock:
    """Stage marks of one call. ``measure``: record times; ``ranges``: open a
    ``torch.profiler.record_function`` range named ``fsdpfn.<stage>`` for each stage."""

    def __init__(self, device: torch.device, *, measure: bool, ranges: bool, stage: str = "plan"):
        self.cuda = measure and device.type == "cuda"
        self.device = device
        self.measure, self.ranges = measure, ranges
        self.marks: list[tuple[str | None, Any]] = []
        self.regions: dict[str, list] = {}
        self._range = None
        self.result: dict[str, float] | None = None  # close()'s answer, set by clock_for
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(device)
        self.start = time.perf_counter()
        self.enter(stage)

    def _now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def enter(self, stage: str | None) -> None:
        """From now until the next mark, time is charged to ``stage`` (None: to no stage)."""
        if self.measure:
            self.marks.append((stage, self._now()))
        if self.ranges:
            self._close_range()
            if stage is not None:
                self._range = torch.profiler.record_function(f"fsdpfn.{stage}")
                self._range.__enter__()

    def _close_range(self) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None

    @contextlib.contextmanager
    def region(self, name: str):
        """Time a nested span (summed over its uses) without moving the stage marks."""
        rf = torch.profiler.record_function(f"fsdpfn.{name}") if self.ranges else None
        if rf is not None:
            rf.__enter__()
        begin = self._now() if self.measure else None
        try:
            yield
        finally:
            if self.measure:
                self.regions.setdefault(name, []).append((begin, self._now()))
            if rf is not None:
                rf.__exit__(None, None, None)

    def close(self) -> dict[str, float] | None:
        """End the call: seconds per stage and per region (one synchronisation on CUDA), and
        ``total`` (host wall time); None when not measuring."""
        self.enter(None)
        self._close_range()
        if not self.measure:
            return None
        if self.cuda:
            self.marks[-1][1].synchronize()
        total = time.perf_counter() - self.start
        out = dict.fromkeys(STAGES, 0.0)
        for (stage, a), (_, b) in zip(self.marks, self.marks[1:]):
            if stage is not None:
                out[stage] = out.get(stage, 0.0) + self._elapsed(a, b)
        for name, spans in self.regions.items():
            out[name] = sum(self._elapsed(a, b) for a, b in spans)
        out["total"] = total
        return out

    def _elapsed(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a


def enter(stage: str) -> None:
    """Mark the start of ``stage`` in the running timed call (a no-op outside one)."""
    clock = _CLOCK.get()
    if clock is not None:
        clock.enter(stage)


@contextlib.contextmanager
def region(name: str):
    """Time a nested span of the running timed call (a no-op outside one)."""
    clock = _CLOCK.get()
    if clock is None:
        yield
        return
    with clock.region(name):
        yield


@contextlib.contextmanager
def clock_for(device: torch.device, *, measure: bool = True, ranges: bool = False,
              stage: str | None = None):
    """Run the block under a new Clock (a call that is not a decorated engine function, e.g.
    push_weights); yields the clock, whose ``result`` is set on exit."""
    clock = Clock(device, measure=measure, ranges=ranges, stage=stage)
    token = _CLOCK.set(clock)
    try:
        yield clock
    finally:
        _CLOCK.reset(token)
        clock.result = clock.close()


# ---------------------------------------------------------------- peak memory and FLOPs


def peak_memory_gb(device: torch.device) -> float:
    """CUDA: the allocator's peak since the call began (its counter is reset at the start of
    each timed call). CPU: the process's peak resident set (never reset)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


def matmul_params(state) -> int:
    """Parameters of the model that take part in matmuls per token: every parameter of two or
    more dimensions (global shapes; tied ones once), the lm_head counted, the embedding lookup
    not. Cached with the model's parameter index."""
    from fsdpfn.engine.state import param_index

    index = param_index(state.model)
    if "matmul_params" not in index.extra:
        total = sum(p.numel() for _, p in index.named if p.dim() >= 2)
        cfg = state.hf_config
        embed = int(getattr(cfg, "vocab_size", 0)) * int(getattr(cfg, "hidden_size", 0))
        tied = bool(getattr(cfg, "tie_word_embeddings", False)) and not state.config.is_critic
        index.extra["matmul_params"] = total if tied else max(total - embed, 0)
    return index.extra["matmul_params"]


def model_flops(state, tokens: float, sum_sq_len: float, passes: int) -> float:
    """FLOPs of ``passes`` passes (1 forward, 3 forward + backward) over the tokens; see the
    module docstring for the formula."""
    cfg = state.hf_config
    layers = int(getattr(cfg, "num_hidden_layers", 0) or 0)
    return passes * (2.0 * matmul_params(state) * tokens
                     + 2.0 * layers * attention_width(cfg) * sum_sq_len)


def attention_width(cfg) -> int:
    """Query heads · head size: the width of attention's two matmuls (Qwen3-0.6B: 16 · 128 =
    2048 on a hidden size of 1024)."""
    hidden = int(getattr(cfg, "hidden_size", 0) or 0)
    heads = int(getattr(cfg, "num_attention_heads", 0) or 0)
    head_dim = getattr(cfg, "head_dim", None) or (hidden // heads if heads else 0)
    return heads * int(head_dim) if heads else hidden


@functools.lru_cache(maxsize=None)
def _measured_tflops(device_index: int, dtype: torch.dtype) -> float | None:
    n = 8192
    try:
        with torch.cuda.device(device_index):
            a = torch.randn(n, n, device="cuda", dtype=dtype)
            b = torch.randn(n, n, device="cuda", dtype=dtype)
            for _ in range(3):
                a @ b
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(10):
                a @ b
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3 / 10
            del a, b
    except torch.OutOfMemoryError:
        return None
    return 2 * n ** 3 / seconds / 1e12


def measure_peak_tflops(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> float | None:
    """The dense matmul rate of ``device`` in ``dtype`` (TFLOP/s), measured once per process by
    an 8192³ GEMM (about 0.4 GB for a few milliseconds); None on CPU or out of memory."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _measured_tflops(index, dtype)


def peak_tflops(state) -> float | None:
    """The peak rate MFU divides by: ``EngineConfig.peak_tflops``, else measured once per
    device and dtype. Measure it while the device is otherwise idle: a call that first measures it
    while another process computes on the same GPU reads it low, and every MFU after high."""
    if state.config.peak_tflops is not None:
        return state.config.peak_tflops
    dtype = torch.bfloat16 if state.config.dtype == "bfloat16" else torch.float32
    return measure_peak_tflops(state.mesh.device, dtype)


# ---------------------------------------------------------------- the decorator


def _row_lengths(batch) -> torch.Tensor:
    from fsdpfn import keys as K
    return batch.get(K.ATTENTION_MASK).sum(dim=1).double().cpu()


def _agree_numbers(state, seconds: dict[str, float], batch):
    """(numbers, tokens, Σ len², peak TFLOP/s or None) of this call, identical on all ranks
    (one all-gather over the world)."""
    names = [*STAGES, "total"]
    lens = _row_lengths(batch)
    replicas = state.mesh.tp * state.mesh.cp  # ranks holding the same rows
    peak = peak_tflops(state)
    local = torch.tensor([seconds.get(n, 0.0) for n in names]
                         + [peak_memory_gb(state.mesh.device), float(lens.sum()) / replicas,
                            float((lens * lens).sum()) / replicas,
                            peak if peak is not None else 0.0], dtype=torch.float64)
    rows = local[None]
    if world_size() > 1:
        parts = [torch.zeros_like(local) for _ in range(world_size())]
        dist.all_gather(parts, local)
        rows = torch.stack(parts)
    n = len(names)
    slowest = rows[int(rows[:, n - 1].argmax())]
    out = {f"time_{name}": float(slowest[i]) for i, name in enumerate(names)}
    tokens, sum_sq = float(rows[:, n + 1].sum()), float(rows[:, n + 2].sum())
    out["peak_memory_gb"] = float(rows[:, n].max())
    out["tokens_per_s"] = tokens / max(out["time_total"], 1e-12)
    return out, tokens, sum_sq, float(rows[0, n + 3]) or None  # rank 0's rate, on every rank


def _numbers(state, seconds, batch, passes: int) -> dict[str, float]:
    out, tokens, sum_sq, peak = _agree_numbers(state, seconds, batch)
    if peak:
        world = world_size()
        flops = model_flops(state, tokens, sum_sq, passes)
        out["mfu"] = flops / (out["time_total"] * world * peak * 1e12)
    return out


def _attach(result, numbers: dict[str, float]):
    """Add the numbers to a stats TensorDict (returned alone or second in a pair)."""
    stats = result[1] if isinstance(result, tuple) else result
    for key, value in numbers.items():
        stats.set(key, torch.tensor(value, dtype=torch.float32))
    return result


def timed(name: str, *, passes: int, attach: bool, step: bool = False) -> Callable:
    """Decorate an engine function ``fn(state, batch, ...)``: run it under a Clock when the
    state's config has ``timing`` (or a profile session wants ranges), then add the numbers to
    its stats (``attach``) and keep them for ``last_timings``. ``step``: the call is a training
    step, counted by ``fsdpfn.profile``, whose record is named after its Objective's ``name``
    (ppo_step, sft_step, ... through grad_step)."""
    def wrap(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            from fsdpfn.engine.state import EngineState

            session = PROFILER.get()
            state = args[0] if args else kwargs.get("state")
            batch = args[1] if len(args) > 1 else kwargs.get("batch")
            if not isinstance(state, EngineState) or not (state.config.timing or session):
                return fn(*args, **kwargs)
            measure = state.config.timing
            # the caller's name: the Objective's (a *_step hands grad_step one)
            objective = args[2] if len(args) > 2 else kwargs.get("loss_fn")
            label = (getattr(objective, "name", None) if step else None) or name
            with contextlib.ExitStack() as stack:
                if session is not None:
                    stack.enter_context(torch.profiler.record_function(f"fsdpfn.{label}"))
                with clock_for(state.mesh.device, measure=measure, ranges=session is not None,
                               stage="plan") as clock:
                    result = fn(*args, **kwargs)
            if measure:
                numbers = _numbers(state, clock.result, batch, passes)
                keep(state.model, label, numbers)
                if attach:
                    _attach(result, numbers)
            if session is not None:
                session.after_call(label, step=step)
            return result
        return call
    return wrap


def keep(model, label: str, numbers: dict[str, float]) -> None:
    """Record ``numbers`` as the last timings of ``label`` on ``model`` (see last_timings)."""
    _LAST.setdefault(model, {})[label] = dict(numbers)


class Phases:
    """Wall time of consecutive phases (shard_model's build, a recipe step's stages):
    ``mark(name)`` ends the phase ``name`` at the host clock, after the device finished its work
    (CUDA: one synchronisation per mark, none in between). ``times``: seconds per phase under
    ``key.format(name)``; ``numbers()``: those and ``time_total``."""

    def __init__(self, device: torch.device | str, key: str = "time_{}"):
        self.cuda = torch.device(device).type == "cuda"
        self.key = key
        self.times: dict[str, float] = {}
        self.start = self.last = self._now()

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def mark(self, name: str) -> None:
        now = self._now()
        key = self.key.format(name)
        self.times[key] = self.times.get(key, 0.0) + now - self.last
        self.last = now

    def numbers(self) -> dict[str, float]:
        return {**self.times, "time_total": self.last - self.start}


def last_timings(state) -> dict[str, dict[str, float]]:
    """The numbers of the last timed call of each function on ``state``'s model (successor
    states share it): ``{"forward_logp": {"time_forward": ..., "time_total": ...,
    "peak_memory_gb": ..., "tokens_per_s": ..., "mfu": ...}, "ppo_step": {...}}``. Keys as in
    the stats of a training step; ``shard_model``: the build's seconds per phase (see
    fsdpfn.engine.shard). Empty with ``timing=False``."""
    if not isinstance(state, EngineState):
        raise ConfigError(f"state: must be an EngineState (shard_model's), got "
                          f"{type(state).__name__}")
    model = state.model
    return {fn: dict(numbers) for fn, numbers in _LAST.get(model, {}).items()}
