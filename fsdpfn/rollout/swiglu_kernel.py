"""The decode step's SiLU(gate) · up as a Triton kernel that drops its inputs from L2 once read.

In the decode step at 512 rows of the Qwen2-1.5B shape, each MLP's gate and up matmuls write
two [R, 8,960] bf16 products (18.4 MB a layer) that only the SwiGLU kernel reads. They sit in L2
as dirty lines, and the next layer's attention, which streams the KV cache, evicts them: the
eviction writes them back to HBM while the attention is reading at HBM rate (BENCHMARKS.md,
"Decode attention kernel": 7 µs of a 90 µs layer when L2 is left dirty). Here each program,
once its products are read (its store of SiLU(gate) · up depends on them, and a barrier orders
the program's threads), invalidates their 128-byte lines with PTX ``discard.global.L2``: the
lines leave L2 without being written back. Nothing reads those products again; the buffers'
next owner writes before it reads.

The arithmetic is Liger-Kernel's SwiGLU forward, element for element: the gate in float32,
times SiLU through ``tl.sigmoid``, cast to the product's dtype, times up. An elementwise kernel
gives the same bits at any tiling; tests/e2e/test_decode_gpu.py holds it to Liger's output bit
for bit. Only whole lines inside a tensor are discarded, and only when it starts on a 128-byte
boundary (torch's allocator aligns to 512): a line it shares with a neighbour is left alone.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["refusal", "silu_mul"]

LINE = 128  # bytes: the L2 line discard.global.L2 invalidates
BLOCK = 4096  # elements a program


def refusal(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the kernel cannot run here (None: it can): CUDA of compute capability 8.0 or newer
    (``discard.global.L2``), bfloat16 or float16, Triton."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return (f"the SwiGLU kernel needs CUDA and bfloat16 or float16, got {device.type} and "
                f"{str(dtype).removeprefix('torch.')}")
    if torch.cuda.get_device_capability(device) < (8, 0):
        return "the SwiGLU kernel's L2 discard needs compute capability 8.0 or newer"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "the SwiGLU kernel needs Triton, which is not installed"
    return None


# PTX: where $2 is non-zero, invalidate the 128-byte L2 line at $1 without writing it back
DROP = ("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p discard.global.L2 [$1], 128; "
        "mov.u32 $0, 0; }")


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    drop = tl.constexpr(DROP)

    @triton.jit
    def silu_mul_kernel(a_ptr, b_ptr, c_ptr, n, gate_multiplier, BLOCK: tl.constexpr,
                        PER_LINE: tl.constexpr, DROP_A: tl.constexpr, DROP_B: tl.constexpr):
        start = tl.program_id(0).to(tl.int64) * BLOCK
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        # times Liger's gate_multiplier (1.0, a float32 argument), as its kernel does
        a = tl.load(a_ptr + offs, mask=mask, other=0).to(tl.float32) * gate_multiplier
        b = tl.load(b_ptr + offs, mask=mask, other=0)
        c = (a * tl.sigmoid(a)).cast(b.dtype) * b
        tl.store(c_ptr + offs, c, mask=mask)
        if DROP_A or DROP_B:
            # every thread's store consumed its loads; the barrier orders all of them before
            # any line is dropped
            tl.debug_barrier()
            first = start + tl.arange(0, BLOCK // PER_LINE) * PER_LINE
            whole = (first + PER_LINE <= n).to(tl.int32)  # lines wholly inside the tensor
            if DROP_A:
                tl.inline_asm_elementwise(drop, "=r,l,r", [a_ptr + first, whole],
                                          dtype=tl.int32, is_pure=False, pack=1)
            if DROP_B:
                tl.inline_asm_elementwise(drop, "=r,l,r", [b_ptr + first, whole],
                                          dtype=tl.int32, is_pure=False, pack=1)

    return silu_mul_kernel


def silu_mul(gate: torch.Tensor, up: torch.Tensor, discard: bool = True) -> torch.Tensor:
    """SiLU(gate) · up, as Liger's SwiGLU forward computes it; with ``discard``, gate's and up's
    L2 lines are invalidated once read (their contents are undefined afterwards: the caller
    must not read them again)."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate and up: must have one shape and dtype, got {tuple(gate.shape)} "
                         f"{gate.dtype} and {tuple(up.shape)} {up.dtype}")
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    n = gate.numel()
    if n == 0:
        return out
    per_line = LINE // gate.element_size()
    _kernel()[(-(-n // BLOCK),)](gate, up, out, n, 1.0, BLOCK=BLOCK, PER_LINE=per_line,
                                 DROP_A=discard and gate.data_ptr() % LINE == 0,
                                 DROP_B=discard and up.data_ptr() % LINE == 0, num_warps=4)
    return out
