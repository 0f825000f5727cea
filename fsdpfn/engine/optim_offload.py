"""PerLayerAdamW: AdamW whose state lives in host memory and is stepped one FSDP unit at a time.

The Adam moments (and, for bf16 master weights, the Kahan compensation) of every parameter live
in host memory, as DTensors shaped like their parameters so checkpoints reshard. When the device
is CUDA that memory is pinned, reserved whole when the optimizer is built: one anonymous mapping
advised for huge pages and registered with the driver (_carve; 5.6x torch's pinned allocator
where measured alone, BENCHMARKS.md "Build time"). ``step()`` walks the FSDP units (decoder
layers, then the root's own parameters) in order; for each unit it

  1. copies the unit's state to the device on a side stream (non-blocking, from pinned memory),
     ``prefetch_layers`` units ahead of the one being stepped; parameters and gradients that live
     on the host (``offload_params``) travel with it;
  2. steps it on the device with torch's AdamW kernel (fused on CUDA; the single-tensor kernel
     elsewhere, as torch.optim.AdamW picks) or fsdpfn.engine.optim's Kahan AdamW;
  3. copies the state (and host parameters) back on a second side stream.

The device never holds the state of more than ``1 + prefetch_layers`` units: before a unit is
loaded, the host waits for the write-back of the unit leaving the window. With ``device`` the CPU
(tests) the state is stepped where it lives: no copies, no streams. The optimizer is a
torch.optim.Optimizer: ``state_dict``/``load_state_dict`` (and DCP's optimizer state helpers) see
the host tensors, LR schedulers set ``param_groups[i]["lr"]``; the result equals
torch.optim.AdamW's (KahanAdamW's with ``kahan=True``) bit for bit.
"""

from __future__ import annotations

import collections
import weakref
from contextlib import nullcontext
from typing import Iterable, Sequence

import attrs
import torch
from torch import nn

from fsdpfn.errors import ConfigError
from fsdpfn.engine.host import available_host_memory
from fsdpfn.engine.optim import CHUNK_NUMEL, kahan_adamw_

__all__ = ["PerLayerAdamW", "fsdp_units"]

_MOMENTS = ("exp_avg", "exp_avg_sq")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t  # noqa: SLF001


def _like_param(local: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``local`` (this rank's part) as a tensor shaped like ``param``: a DTensor when it is one,
    wrapping ``local`` itself wherever it lives. (DTensor.from_local would move a host tensor to
    the mesh's device type: on a CUDA mesh the state meant for pinned host memory would land on
    the GPU. FSDP2 builds its CPU-offloaded parameters the same direct way.)"""
    if not hasattr(param, "_local_tensor"):
        return local
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    spec = DTensorSpec(param.device_mesh, tuple(param.placements),
                       tensor_meta=TensorMeta(param.shape, param.stride(), local.dtype))
    return DTensor(local, spec, requires_grad=False)


def fsdp_units(model: nn.Module) -> list[list[nn.Parameter]]:
    """Trainable parameters by FSDP unit: each non-root FSDP module's (in module order), then
    the rest (the root's own: embeddings, final norm, heads)."""
    from torch.distributed.fsdp import FSDPModule

    units, seen = [], set()
    for name, module in model.named_modules():
        if not name or not isinstance(module, FSDPModule):
            continue
        params = [p for p in module.parameters() if p.requires_grad and id(p) not in seen]
        seen.update(id(p) for p in params)
        if params:
            units.append(params)
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in seen]
    return units + ([rest] if rest else [])


def _fast_pinning() -> None:
    """Pinned allocations through torch's register path: the pages are touched by several
    threads, then registered with the driver (``pinned_use_cuda_host_register``), instead of one
    cudaHostAlloc call that faults them in alone (about 1.5 GB/s: 30 s of a 7B model's build
    for its 45 GB of bf16 moments). Left as the user set it when PYTORCH_CUDA_ALLOC_CONF names
    either setting; a torch without the settings keeps its default."""
    import os

    if "pinned_" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
        return
    threads = max(1, min(16, os.cpu_count() or 1))
    setting = f"pinned_use_cuda_host_register:True,pinned_num_register_threads:{threads}"
    for where in (getattr(torch._C, "_accelerator_setAllocatorSettings", None),  # noqa: SLF001
                  getattr(torch._C, "_cuda_cudaCachingAllocator_set_allocator_settings", None)):
        if where is not None:
            try:
                where(setting)
                return
            except (RuntimeError, TypeError, ValueError):
                continue


def _register(ptr: int, nbytes: int) -> bool:
    """Page-lock [ptr, ptr + nbytes) with the CUDA driver (True: done)."""
    try:
        return int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0)) == 0
    except (RuntimeError, AttributeError, TypeError):
        return False


def _unregister(ptr: int) -> None:
    """Undo _register (the memory stays valid, pageable, for whatever still views it)."""
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # noqa: BLE001 - at teardown the driver may be gone already
        pass


HUGE_PAGE = 2 << 20


def _mapped(nbytes: int) -> torch.Tensor:
    """``nbytes`` (a multiple of 2 MiB) of host memory as a uint8 tensor over an anonymous
    mapping advised MADV_HUGEPAGE (2 MiB pages where the kernel's transparent huge pages allow
    it), every page touched by torch's threads. The mapping lives as long as a tensor views it."""
    import mmap

    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        m.madvise(mmap.MADV_HUGEPAGE)
    block = torch.frombuffer(m, dtype=torch.uint8)
    block.as_strided((nbytes // 4096,), (4096,)).fill_(0)  # first touch, in parallel
    return block


def _pinned_mapping(nbytes: int, register=_register) -> torch.Tensor | None:
    """``nbytes`` of pinned host memory as one huge-page mapping (_mapped) registered with the
    driver: 14.6 GB/s on the GPU host, against 2.6 GB/s for torch's pinned allocator on its
    register path and about 1.5 GB/s for cudaHostAlloc (BENCHMARKS.md, "Build time"). None where
    it cannot be had (no mmap, more than the host's available memory, the driver refuses): the
    caller then takes torch's pinned allocator, which fails as it always did on a host short of
    memory rather than the kernel killing the process at first touch."""
    nbytes = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    if nbytes > (available_host_memory() or 0):
        return None
    try:
        block = _mapped(nbytes)
    except (OSError, ValueError, RuntimeError):
        return None
    return block if register(block.data_ptr(), nbytes) else None


def _carve(requests: Sequence[tuple[torch.Size, torch.dtype]], pin: bool,
           register=_register) -> tuple[list[torch.Tensor], list[int]]:
    """Host tensors of the requested shapes and dtypes (uninitialised: the optimizer zeroes a
    parameter's state at its first step, or a checkpoint load overwrites it), pinned when
    ``pin``, 512-byte aligned; and the addresses registered with the driver (for _unregister
    when the optimizer goes).

    Pinned, the tensors are laid end to end in one huge-page mapping registered with the driver
    (_pinned_mapping). Otherwise (or where that mapping cannot be had) they are carved from
    blocks whose sizes are powers of two: torch's pinned allocator rounds every request up to a
    power of two, so pinning the state tensor by tensor took up to twice its bytes (a 7B model's
    61 GB of fp32 moments asked for 116 GB); the tensors are placed largest first into the first
    block with room (blocks of the smallest power of two that holds the largest tensor; the last
    ones cut to the power of two their contents need)."""
    align = 512
    nbytes = [shape.numel() * torch.empty((), dtype=dtype).element_size()
              for shape, dtype in requests]
    sizes = [-(-max(1, n) // align) * align for n in nbytes]
    mapped = _pinned_mapping(sum(sizes), register) if pin and requests else None
    if mapped is not None:
        starts = [0]
        for size in sizes[:-1]:
            starts.append(starts[-1] + size)
        return ([mapped[at:at + n].view(dtype).view(shape)
                 for at, n, (shape, dtype) in zip(starts, nbytes, requests)],
                [mapped.data_ptr()])
    block = 1 << max(20, (max(sizes, default=1) - 1).bit_length())
    used: list[int] = []
    where = [(0, 0)] * len(requests)
    for i in sorted(range(len(requests)), key=lambda i: -sizes[i]):
        b = next((j for j, u in enumerate(used) if u + sizes[i] <= block), len(used))
        if b == len(used):
            used.append(0)
        where[i], used[b] = (b, used[b]), used[b] + sizes[i]
    if pin:
        _fast_pinning()
    blocks = [torch.empty(1 << max(20, (u - 1).bit_length()), dtype=torch.uint8, pin_memory=pin)
              for u in used]
    return [blocks[b][off:off + n].view(dtype).view(shape)
            for (b, off), n, (shape, dtype) in zip(where, nbytes, requests)], []


@attrs.define
class _Part:
    """One parameter group's share of one unit, as the kernel sees it (device tensors)."""

    group: dict
    params: list
    params_dev: list
    grads_dev: list
    states_dev: dict        # name -> list of device tensors
    states_host: dict       # name -> list of host (local) tensors


@attrs.define
class _Loaded:
    parts: list
    event: object = None    # CUDA event after the last copy of this stage


class PerLayerAdamW(torch.optim.Optimizer):
    """AdamW (``kahan=True``: Kahan-compensated AdamW for bf16 parameters) with host-resident
    state streamed to ``device`` one unit of ``units`` at a time; see the module docstring."""

    def __init__(self, params, *, units: Iterable[Sequence[torch.Tensor]], device,
                 lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, prefetch_layers: int = 1, kahan: bool = False,
                 chunk_numel: int = CHUNK_NUMEL):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        if not isinstance(prefetch_layers, int) or isinstance(prefetch_layers, bool) \
                or prefetch_layers < 0:
            raise ConfigError(f"fsdp.optim_step_prefetch_layers: must be an integer >= 0, got "
                              f"{prefetch_layers!r}")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.prefetch_layers = prefetch_layers
        self.kahan = kahan
        self.chunk_numel = chunk_numel
        self._pin = self.device.type == "cuda"
        self._units = self._order(units)
        params = [p for unit in self._units for _, p in unit]
        carved, registered = _carve([(_local(p).shape, _local(p).dtype) for p in params
                                     for _ in self.state_names], self._pin)
        carved = iter(carved)
        # the registration goes with the optimizer (views left elsewhere stay valid, pageable)
        for ptr in registered:
            weakref.finalize(self, _unregister, ptr).atexit = False
        # every parameter's state, reserved in host memory up front (a host short of memory
        # fails here, at build time, not in the first step)
        self._reserved = {id(p): {name: next(carved) for name in self.state_names}
                          for p in params}
        self._streams = ((torch.cuda.Stream(self.device), torch.cuda.Stream(self.device))
                         if self.device.type == "cuda" else None)

    # ------------------------------------------------------------ layout

    def _order(self, units) -> list[list[tuple[int, torch.Tensor]]]:
        """(group index, param) per unit; parameters of no unit form a last one."""
        group_of = {id(p): i for i, g in enumerate(self.param_groups) for p in g["params"]}
        out, seen = [], set()
        for unit in units:
            entries = [(group_of[id(p)], p) for p in unit
                       if id(p) in group_of and id(p) not in seen]
            seen.update(id(p) for _, p in entries)
            if entries:
                out.append(entries)
        rest = [(i, p) for i, g in enumerate(self.param_groups) for p in g["params"]
                if id(p) not in seen]
        return out + ([rest] if rest else [])

    @property
    def state_names(self) -> tuple[str, ...]:
        return _MOMENTS + (("compensation",) if self.kahan else ())

    def _step_tensor(self, value) -> torch.Tensor:
        out = torch.as_tensor(value).detach().to("cpu", torch.float32).reshape(()).clone()
        return out.pin_memory() if self._pin else out

    def empty_state_like(self, param: torch.Tensor) -> torch.Tensor:
        """A host buffer for one state tensor of ``param``: checkpoint loads read into it, then
        load_state_dict copies it into the reserved state (plain memory: it is never sent to
        the device)."""
        local = _local(param)
        return _like_param(torch.empty(local.shape, dtype=local.dtype), param)

    def _state_of(self, param: torch.Tensor) -> dict:
        state = self.state[param]
        if not state:
            state["step"] = self._step_tensor(0.0)
            for name in self.state_names:
                state[name] = _like_param(self._reserved[id(param)][name].zero_(), param)
        return state

    # ------------------------------------------------------------ checkpoints

    def load_state_dict(self, state_dict) -> None:
        """torch's load, with every state tensor copied to host memory (never to the device)."""
        saved = [pid for g in state_dict["param_groups"] for pid in g["params"]]
        live = [p for g in self.param_groups for p in g["params"]]
        entries = state_dict["state"]
        for pid, param in zip(saved, live):  # every shape checked before anything is copied
            for key, value in entries.get(pid, {}).items():
                if key != "step" and key not in self.state_names:
                    raise ValueError(f"optimizer state {key!r} of parameter {pid}: must be one "
                                     f"of {('step',) + self.state_names}, got {key!r}")
                if key != "step" and _local(value).numel() != _local(param).numel():
                    raise ValueError(f"optimizer state {key!r} of parameter {pid}: must have "
                                     f"{_local(param).numel()} elements (this rank's shard), "
                                     f"got {_local(value).numel()}")
        super().load_state_dict({**state_dict, "state": {}})  # validates, restores the groups
        for pid, param in zip(saved, live):
            if pid not in entries:
                continue
            state = {}
            for key, value in entries[pid].items():
                if key == "step":
                    state[key] = self._step_tensor(value)
                    continue
                host = self._reserved[id(param)][key]
                host.copy_(_local(value).detach().reshape(host.shape))
                state[key] = _like_param(host, param)
            self.state[param] = state

    # ------------------------------------------------------------ the step

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._pipeline([unit for unit in (self._with_grads(u) for u in self._units) if unit])
        return loss

    def _with_grads(self, unit) -> list[tuple[dict, list]]:
        by_group: dict[int, list] = {}
        for index, param in unit:
            if param.grad is not None:
                by_group.setdefault(index, []).append(param)
        return [(self.param_groups[i], ps) for i, ps in sorted(by_group.items())]

    def _pipeline(self, work) -> None:
        """Step every unit in order: unit i's step is issued as soon as it is loaded, then the
        next ``prefetch_layers`` units are loaded behind it. At most 1 + prefetch_layers units'
        state is on the device, counting those still being written back."""
        window = 1 + self.prefetch_layers
        loaded: dict[int, _Loaded] = {}
        writing: collections.deque = collections.deque()
        issued = 0

        def load_next():
            nonlocal issued
            while len(loaded) + len(writing) >= window:
                self._release(writing.popleft())
            loaded[issued] = self._load(work[issued])
            issued += 1

        for i in range(len(work)):
            if i == issued:  # not prefetched: the first unit, or prefetch_layers=0
                load_next()
            # no local name keeps the unit alive: once released, its device copies are freed
            writing.append(self._store(self._compute(loaded.pop(i))))
            while issued < min(len(work), i + 1 + self.prefetch_layers):
                load_next()
        while writing:  # host state (and offloaded parameters) complete before step() returns
            self._release(writing.popleft())

    def _release(self, unit: _Loaded) -> None:
        """Wait for a unit's write-back; dropping it then frees its device copies."""
        if unit.event is not None:
            unit.event.synchronize()

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device == self.device:
            return tensor
        return tensor.to(self.device, non_blocking=True)

    def _load(self, unit) -> _Loaded:
        """Stage 1: the unit's state (and host parameters and gradients) on the device."""
        parts = []
        context = torch.cuda.stream(self._streams[0]) if self._streams else nullcontext()
        with context:
            if self._streams:  # gradients clipped on the compute stream are final
                self._streams[0].wait_stream(torch.cuda.current_stream(self.device))
            for group, params in unit:
                states = [self._state_of(p) for p in params]
                host = {k: [_local(s[k]) for s in states] for k in ("step",) + self.state_names}
                locals_ = [_local(p) for p in params]
                parts.append(_Part(
                    group=group, params=params,
                    params_dev=[self._to_device(p) for p in locals_],
                    grads_dev=[self._to_device(_local(p.grad)) for p in params],
                    states_dev={k: [self._to_device(t) for t in ts] for k, ts in host.items()},
                    states_host=host))
            event = self._streams[0].record_event() if self._streams else None
        return _Loaded(parts, event)

    def _compute(self, unit: _Loaded) -> _Loaded:
        """Stage 2: the optimizer math on the device (the current stream)."""
        if unit.event is not None:
            torch.cuda.current_stream(self.device).wait_event(unit.event)
        for part in unit.parts:
            self._kernel(part)
        if self._streams:
            unit.event = torch.cuda.current_stream(self.device).record_event()
        return unit

    def _kernel(self, part: _Part) -> None:
        group, dev = part.group, part.states_dev
        beta1, beta2 = group["betas"]
        if self.kahan:
            kahan_adamw_(part.params_dev, part.grads_dev, dev["exp_avg"], dev["exp_avg_sq"],
                         dev["compensation"], dev["step"], lr=group["lr"], beta1=beta1,
                         beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                         chunk_numel=self.chunk_numel)
            return
        from torch.optim.adam import adam

        fused = self.device.type == "cuda"  # as fsdpfn.engine.optim_build.build_optimizer picks for AdamW
        adam(part.params_dev, part.grads_dev, dev["exp_avg"], dev["exp_avg_sq"], [], dev["step"],
             foreach=False, fused=fused or None, amsgrad=False, has_complex=False, beta1=beta1,
             beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
             maximize=False, decoupled_weight_decay=True)

    def _store(self, unit: _Loaded) -> _Loaded:
        """Stage 3: state (and host parameters) back to the host, on the second side stream
        (without streams the state was stepped where it lives: nothing to copy)."""
        if self._streams is None:
            return unit
        d2h = self._streams[1]
        d2h.wait_event(unit.event)
        with torch.cuda.stream(d2h):
            for part in unit.parts:
                pairs = [(_local(p), d) for p, d in zip(part.params, part.params_dev)]
                for name, hosts in part.states_host.items():
                    pairs += zip(hosts, part.states_dev[name])
                for host, dev in pairs:
                    if dev is not host:  # a copy was made: write it back
                        host.copy_(dev, non_blocking=True)
            unit.event = d2h.record_event()
        return unit
