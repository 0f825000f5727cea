"""The content checksum of tensors: what a checkpoint records and what a weights push compares.

Definition. A tensor's bytes (little-endian, row-major) are read as a sequence of units u_0 ..
u_{n-1}: signed (two's complement) 16-bit halfwords, or unsigned bytes for 1-byte dtypes (and
any odd byte count). Its checksum is the polynomial

    H = sum_i u_i * R**i   modulo the Mersenne prime P = 2**61 - 1,

with R a fixed primitive root modulo P (``ROOT``). It is exact integer arithmetic: every device
and every reduction order give the same value, so a chunk hashed on a GPU at save matches the same
chunk hashed on a CPU at load.

What it detects, with the reasons (``tests/unit/test_checksum.py`` checks each premise):

* every error confined to one unit: the change d of that unit satisfies 0 < |d| < 2**16 < P, and
  d * R**i is then nonzero modulo the prime P (a flip of bit k changes the unit by ±2**k);
* every 2-bit error in a tensor of fewer than 2**54 units: bits in units i < j change H by
  ±2**a R**i ± 2**b R**j, which vanishes only if R**(j-i) lies in {±2**m} (2 has order 61 modulo
  P, so that set is the subgroup of order 122); R is primitive, so R**d is in that subgroup only
  when (P-1)/122 (about 2**54.07) divides d;
* every burst of up to 32 bits in halfword units (16 bits in byte units): such a burst touches
  at most three consecutive units, and R was chosen so that no change pattern of that shape sums
  to zero (an exhaustive search over the patterns, repeated by the test).

A permutation, a swap or a negation of two words changes H as well (unlike a plain or
position-weighted sum). Beyond these guarantees, two different contents collide with probability
about n / P.

Where it runs. The positional weights split along any box of a chunk: the unit at coordinates
q of a box placed at ``offsets`` in a chunk of row-major unit strides s has the weight
R**(sum_d (offsets_d + q_d) s_d) = prod_d (R**s_d)**(offsets_d + q_d). So each row of the box's
last dim is reduced against one vector of powers (a float64 matrix product whose partial sums
stay below 2**53, hence exact, on any device; on CUDA the push's 4 KiB rows take a Triton pass,
``fsdpfn.wire.fused``), then the row values are weighted by the small outer vectors. The hashes
of disjoint boxes of one chunk add up (modulo P) to the chunk's: a load at another world size
completes each chunk's checksum by a sum over the ranks.
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch

from fsdpfn.wire import fused

__all__ = ["P", "ROOT", "ALGORITHM", "units", "box_hash", "tensor_hash", "tensor_hashes",
           "mulmod", "sum_mod", "combine", "join_halves", "row_hashes", "weighted_rows", "powers"]

P = (1 << 61) - 1
ROOT = 0x1F0E5C2B3A49D68A  # a primitive root modulo P, chosen for the burst guarantee
ALGORITHM = "poly-mod-2**61-1-r1f0e5c2b3a49d68a-u16"
_M31 = (1 << 31) - 1
_LIMB = 21  # float64 limbs of the powers: a unit (|u| <= 2**15) times a limb is below 2**36
_COLS = 1 << 16  # columns per matrix product: sums of 2**16 such products stay below 2**52


# ---------------------------------------------------------------- arithmetic modulo P


def _fold(x: torch.Tensor) -> torch.Tensor:
    """x modulo P for int64 x in [0, 2**63)."""
    x = (x & P) + (x >> 61)
    return torch.where(x >= P, x - P, x)


def _shift(x: torch.Tensor, k: int) -> torch.Tensor:
    """x * 2**k modulo P for x in [0, P), 0 <= k < 61 (2**61 = 1 modulo P: a rotation)."""
    return _fold(((x & ((1 << (61 - k)) - 1)) << k) + (x >> (61 - k)))


def mulmod(x: torch.Tensor, y: torch.Tensor | int) -> torch.Tensor:
    """x * y modulo P for int64 tensors in [0, P) (broadcasting; ``y`` may be a Python int, which
    costs no copy to the device), in 31-bit limbs so that no product leaves int64."""
    x0, x1 = x & _M31, x >> 31
    y0, y1 = y & _M31, y >> 31
    mid = x1 * y0 + x0 * y1  # < 2**62
    low = _fold(x0 * y0)
    return _fold(low + 2 * (x1 * y1) + (mid >> 30) + ((mid & ((1 << 30) - 1)) << 31))


def sum_mod(x: torch.Tensor, dim=None) -> torch.Tensor:
    """The sum modulo P of int64 values in [0, P) (over ``dim``, or all), exact for up to 2**32
    terms: the 31-bit halves are summed apart."""
    low = (x & _M31).sum(dim) if dim is not None else (x & _M31).sum()
    high = (x >> 31).sum(dim) if dim is not None else (x >> 31).sum()
    return join_halves(low, high)


def join_halves(low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """(low + high * 2**31) modulo P for int64 sums of 31-bit low and 30-bit high halves of
    values (each sum in [0, 2**63)): how sums of many values modulo P are taken exactly."""
    return _fold(_fold(low) + _shift(_fold(high), 31))


@functools.lru_cache(maxsize=128)
def _powers_cpu(base: int, n: int) -> torch.Tensor:
    out = torch.ones(1, dtype=torch.int64)
    step = base % P
    while out.numel() < n:  # doubling: [1, b, .., b**(k-1)] -> then times b**k
        out = torch.cat([out, mulmod(out, step)])
        step = step * step % P
    return out[:n]


@functools.lru_cache(maxsize=128)
def _powers_on(base: int, n: int, device: str) -> torch.Tensor:
    return _powers_cpu(base, n).to(device)


def powers(base: int, n: int, device) -> torch.Tensor:
    """[base**0, ..., base**(n-1)] modulo P, int64 on ``device`` (cached)."""
    return _powers_on(int(base) % P, int(n), str(torch.device(device)))


@functools.lru_cache(maxsize=128)
def _limbs_on(n: int, device: str) -> torch.Tensor:
    """R**b for b < n as three 21-bit limbs, float64 [n, 3] on ``device``."""
    pw = _powers_cpu(ROOT, n)
    limbs = [(pw >> (_LIMB * k)) & ((1 << _LIMB) - 1) for k in range(3)]
    return torch.stack(limbs, 1).to(torch.float64).to(device)


@functools.lru_cache(maxsize=16)
def _word_limbs(width: int, device: str) -> tuple[torch.Tensor, ...]:
    """The fused kernel's coefficients for rows of ``width`` halfwords: the 31-bit low and 30-bit
    high limbs of R**(2b) and R**(2b+1) for each 32-bit word b, int32 on ``device``."""
    pw = powers(ROOT, width, device)
    return tuple((x & _M31 if k == 0 else x >> 31).to(torch.int32).contiguous()
                 for x in (pw[0::2], pw[1::2]) for k in (0, 1))


def _fused_values(rows: torch.Tensor, weights: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """fused.row_values where its kernel can run on ``rows``, else None."""
    if not fused.usable(rows):
        return None
    return fused.row_values(rows, _word_limbs(rows.shape[1], str(rows.device)), weights)


# ---------------------------------------------------------------- units and row hashes


def units(t: torch.Tensor) -> torch.Tensor:
    """The units of ``t`` (module doc) as a tensor of ``t``'s shape, the last dim multiplied by
    the units per element: int16 halfwords, or uint8 for 1-byte dtypes.
    A view where possible (the last dim contiguous)."""
    t = t.detach()
    if t.dim() == 0:
        t = t.reshape(1)
    if t.is_complex():
        t = torch.view_as_real(t).flatten(-2)
    if t.stride(-1) != 1:
        t = t.contiguous()
    if t.element_size() == 1:
        return t.view(torch.uint8)
    try:
        return t.view(torch.int16)
    except RuntimeError:  # the view needs every other stride a multiple of the element size
        return t.contiguous().view(torch.int16)


def row_hashes(rows: torch.Tensor, first: int = 0) -> torch.Tensor:
    """sum_b u[a, b] * R**(first + b) modulo P for every row a of the unit matrix ``rows``
    [A, C] (int16 or uint8): int64 [A] on rows' device, not read."""
    n_rows, width = rows.shape
    out = torch.zeros(n_rows, dtype=torch.int64, device=rows.device)
    if n_rows == 0 or width == 0:
        return out
    done = _fused_values(rows) if first == 0 else None
    if done is not None:
        return done[0] + (done[1] << 31)
    limbs = _limbs_on(first + width, str(rows.device))[first:]
    block = max(1, (1 << (24 if rows.is_cuda else 20)) // min(width, _COLS))
    for c0 in range(0, width, _COLS):
        c1 = min(width, c0 + _COLS)
        for r0 in range(0, n_rows, block):
            part = rows[r0:r0 + block, c0:c1].to(torch.float64)
            sums = (part @ limbs[c0:c1]).to(torch.int64) % P  # exact: |sums| < 2**52
            value = _fold(sums[:, 0] + _shift(sums[:, 1], _LIMB))
            value = _fold(value + _shift(sums[:, 2], 2 * _LIMB))
            out[r0:r0 + block] = _fold(out[r0:r0 + block] + value)
    return out


# ---------------------------------------------------------------- boxes and tensors


def _strides(sizes: Sequence[int]) -> list[int]:
    out, step = [], 1
    for size in reversed(list(sizes)):
        out.append(step)
        step *= int(size)
    return out[::-1]


def box_hash(box: torch.Tensor, chunk_sizes: Sequence[int] | None = None,
             box_offsets: Sequence[int] | None = None) -> torch.Tensor:
    """The checksum's share of ``box``, a sub-box at ``box_offsets`` (elements) of a chunk of
    ``chunk_sizes`` (the whole chunk, ``box.shape``, by default): a 0-d int64 tensor on box's
    device, not read. The shares of disjoint boxes covering a chunk add up, modulo P, to the
    chunk's tensor_hash."""
    u = units(box)
    per = u.shape[-1] // max(1, (box.shape[-1] if box.dim() else 1))
    sizes = list(chunk_sizes) if chunk_sizes is not None else list(box.shape)
    offsets = list(box_offsets) if box_offsets is not None else [0] * len(sizes)
    if not sizes:
        sizes, offsets = [1], [0]
    sizes[-1], offsets[-1] = sizes[-1] * per, offsets[-1] * per  # in units from here on
    if u.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=u.device)
    strides = _strides(sizes)
    rows = u.reshape(-1, u.shape[-1])
    if len(sizes) == 1 or (not any(offsets) and list(u.shape) == sizes):
        return _long_hash(rows.reshape(-1), offsets[-1])  # a whole chunk: one run of units
    acc = row_hashes(rows, offsets[-1]).reshape(u.shape[:-1])
    for dim in range(len(sizes) - 2, -1, -1):  # weight and sum the outer dims, innermost first
        step = pow(ROOT, strides[dim], P)
        weights = mulmod(powers(step, acc.shape[-1], acc.device),
                         pow(step, offsets[dim], P))
        acc = sum_mod(mulmod(acc, weights), -1)
    return acc


_ROW = 2048  # units per row when a long run of units is hashed


def weighted_rows(rows: torch.Tensor, weights: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """row_hashes(rows) times ``weights`` (int64 [A] in [0, P)) modulo P, as 31-bit low and
    30-bit high halves (int64 [A] each), ready to be summed: one fused pass on CUDA."""
    done = _fused_values(rows, weights)
    if done is not None:
        return done
    value = mulmod(row_hashes(rows), weights)
    return value & _M31, value >> 31


def _long_hash(flat: torch.Tensor, first: int) -> torch.Tensor:
    """sum_i u_i * R**(first + i) modulo P of a 1-D run of units, in rows of _ROW units."""
    full = flat.numel() // _ROW * _ROW
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    if full:
        weights = powers(pow(ROOT, _ROW, P), full // _ROW, flat.device)
        low, high = weighted_rows(flat[:full].reshape(-1, _ROW), weights)
        total = join_halves(low.sum(), high.sum())
    if flat.numel() > full:
        tail = row_hashes(flat[full:].reshape(1, -1))[0]
        total = _fold(total + mulmod(tail, pow(ROOT, full, P)))
    return mulmod(total, pow(ROOT, first, P)) if first else total


def tensor_hash(t: torch.Tensor) -> int:
    """The checksum H of ``t``'s bytes (module doc), an int in [0, P)."""
    return int(box_hash(t.reshape(-1) if t.dim() else t).item())


def combine(hashes: torch.Tensor, ranks: torch.Tensor) -> torch.Tensor:
    """sum_i ranks[i] * hashes[i] modulo P, a 0-d int64 tensor on their device, not read: the
    checksums of several tensors folded into one, each weighted by its 1-based rank (``ranks``,
    below P) so that a swap of two tensors' contents changes the result. ``hashes`` are int64
    read as unsigned 64-bit values (a checksum in [0, P) is itself). Exact for up to 2**32
    tensors (sum_mod)."""
    unsigned = (hashes & P) + ((hashes >> 61) & 7)  # x = a + 2**61 b = a + b modulo P
    return sum_mod(mulmod(_fold(unsigned), ranks))


def tensor_hashes(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """H of each tensor's bytes, one int64 tensor on the first one's device, not read."""
    return torch.stack([box_hash(t.reshape(-1) if t.dim() else t).to(tensors[0].device)
                        for t in tensors])
