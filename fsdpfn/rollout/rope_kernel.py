"""The decode step's q/k/v epilogue as one Triton kernel (``SlotModel(rope_kv="triton")``).

After the fused q/k/v matmul, each layer of the decode step otherwise runs the rotary of q and k
(four elementwise kernels: two products, a roll, a sum), a copy of q into its own layout and two
indexed writes of k and v into the slot cache: seven of the dozen small kernels a layer that
together take 2.2 ms of a 7.1 ms step at 512 rows of the Qwen2-1.5B shape (BENCHMARKS.md,
"Decode step profile"). Here one kernel does all of it, one program per row of the matmul's
output and up to 2,048 / D of its heads (the row's position and rotary entries loaded once for
them; one program per head spent its time waiting on those dependent loads):

- q heads: rotated, written to ``q_out`` [R, heads, D];
- k heads: rotated, written to the layer's k cache at the row's slot and position;
- v heads: written to the v cache there.

The rotary is HF's, bit for bit in the model's half dtype: x·cos and rotate_half(x)·sin each
rounded to the dtype (a product of two half-precision values is exact in float32, so rounding it
once is what torch's half multiply does), then their sum rounded. The kernel is compiled without
floating-point contraction (``enable_fp_fusion=False``): Triton otherwise fuses a product and the
sum into one FMA, which rounds once where HF rounds twice (on the H200 a quarter of q's elements
then differed by an ulp). Models with per-head q/k norms (Qwen3) keep the torch path. The server
takes it where it runs (``--decode-rope-kv auto``); tests/e2e/test_decode_gpu.py checks it bit
for bit, benchmarks/decode_step.py's ``rope-kv`` row times it.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["refusal", "rope_kv"]


def refusal(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why the kernel cannot run here (None: it can): CUDA, Triton, a half dtype, an even
    power-of-two head size up to 256."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return (f"rope_kv='triton' needs CUDA and bfloat16 or float16, got {device.type} and "
                f"{str(dtype).removeprefix('torch.')}")
    if head_dim < 2 or head_dim > 256 or head_dim & (head_dim - 1):
        return f"rope_kv='triton' needs a power-of-two head size up to 256, got {head_dim}"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "rope_kv='triton' needs Triton, which is not installed"
    return None


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def rope_kv_kernel(qkv, cos, sin_signed, pos, q_out, k_cache, v_cache, s_qkv, s_tab,
                       s_slot, s_head, s_pos, NQ: tl.constexpr, NK: tl.constexpr,
                       D: tl.constexpr, BLOCK_H: tl.constexpr):
        # one program per row and BLOCK_H of its heads: the row's position and its rotary
        # entries are loaded once for all of them, and the heads' loads are independent
        r = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
        d = tl.arange(0, D)[None, :]  # [1, D]
        p = tl.load(pos + r).to(tl.int64)
        live = h < NQ + 2 * NK
        src = qkv + r * s_qkv + h * D
        x = tl.load(src + d, mask=live, other=0.0)
        rotated = h < NQ + NK
        rolled = tl.load(src + (d + D // 2) % D, mask=rotated, other=0.0)  # x.roll(D // 2)
        c = tl.load(cos + p * s_tab + d)
        s = tl.load(sin_signed + p * s_tab + d)
        a = (x.to(tl.float32) * c.to(tl.float32)).to(x.dtype)
        b = (rolled.to(tl.float32) * s.to(tl.float32)).to(x.dtype)
        y = tl.where(rotated, (a.to(tl.float32) + b.to(tl.float32)).to(x.dtype), x)
        tl.store(q_out + (r * NQ + h) * D + d, y, mask=h < NQ)
        at = r * s_slot + p * s_pos + d
        y = y.to(k_cache.dtype.element_ty)  # a float8 cache: rounded (else the identity)
        tl.store(k_cache + at + (h - NQ) * s_head, y, mask=rotated & (h >= NQ))
        tl.store(v_cache + at + (h - NQ - NK) * s_head, y, mask=live & (h >= NQ + NK))

    return rope_kv_kernel


def rope_kv(qkv: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor, pos: torch.Tensor,
            k_cache: torch.Tensor, v_cache: torch.Tensor, q_heads: int, kv_heads: int
            ) -> torch.Tensor:
    """qkv [R, (q_heads + 2 kv_heads) * D] (the fused matmul's output, bias added; rows
    contiguous), the rotary tables cos and sin_signed [L, D] (sin with its first half negated),
    pos [R] (row r's position, slot r): writes rotated k and v into the caches [S, kv, L, D] at
    [r, :, pos[r]] and returns rotated q [R, q_heads, D]."""
    R = qkv.shape[0]
    D = k_cache.shape[-1]
    assert qkv.stride(-1) == 1 and cos.stride() == sin_signed.stride() and cos.stride(-1) == 1
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    q = torch.empty(R, q_heads, D, dtype=qkv.dtype, device=qkv.device)
    if R:
        heads = q_heads + 2 * kv_heads
        block = min(1 << (heads - 1).bit_length(), max(1, 2048 // D))
        _kernel()[(R, -(-heads // block))](
            qkv, cos, sin_signed, pos, q, k_cache, v_cache, qkv.stride(0), cos.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), NQ=q_heads, NK=kv_heads,
            D=D, BLOCK_H=block, num_warps=4, enable_fp_fusion=False)
    return q
