"""The content checksum (fsdpfn.wire.checksum): the premises of its guarantees, each checked with
independent arithmetic (sympy's primality and factoring, Python integers), and the guarantees
themselves on real tensors: every single-bit flip, samples of 2-bit errors near and far apart,
bursts up to 32 bits, and the negated pair that fooled the earlier sums."""

from __future__ import annotations

import random

import numpy as np
import pytest
import sympy
import torch

from fsdpfn.wire import checksum as C

P = 2**61 - 1


def test_the_modulus_is_prime_and_the_root_is_primitive():
    assert sympy.isprime(P) and C.P == P
    for q in sympy.factorint(P - 1):
        assert pow(C.ROOT, (P - 1) // q, P) != 1, q


def test_two_bit_errors_cannot_cancel_below_2_to_54_units():
    """±2**a R**i ± 2**b R**j = 0 needs R**(j-i) in {±2**m}: the subgroup of order 122 (2 has
    order 61), reached by a primitive R only at multiples of (P - 1) / 122."""
    assert sympy.n_order(2, P) == 61
    subgroup = {pow(2, m, P) for m in range(61)} | {P - pow(2, m, P) for m in range(61)}
    assert len(subgroup) == 122 and all(pow(x, 122, P) == 1 for x in subgroup)
    assert (P - 1) % 122 == 0 and (P - 1) // 122 > 2**54


def _three_units_clear(unit_bits: int, burst: int) -> bool:
    """No burst of ``burst`` bits over three consecutive units of ``unit_bits`` cancels:
    d0 + R d1 + R**2 d2 = 0 with d0 = a 2**k (|a| < 2**(u-k)), any |d1| < 2**u, 0 < |d2| < 2**m."""
    r, lim = C.ROOT, 1 << unit_bits
    rinv = pow(r, P - 2, P)
    for k in range(1, unit_bits):
        m = burst - (unit_bits - k) - unit_bits
        if m <= 0:
            continue
        step = (1 << k) * rinv % P
        span = range(1, 1 << (unit_bits - k))
        a = np.array([x * step % P for x in span] + [(P - x) * step % P for x in span],
                     dtype=np.uint64)
        for b in range(1, 1 << m):  # -d2 is covered by negating the whole pattern
            y = (a + np.uint64(r * r % P * b % P * rinv % P)) % np.uint64(P)
            if ((y < lim) | (y > P - lim)).any():
                return False
    return True


@pytest.mark.parametrize("unit_bits,burst", [(16, 32), (8, 16)])
def test_no_burst_over_two_or_three_units_cancels(unit_bits, burst):
    """The exhaustive search behind the burst guarantee: d0 + R d1 = 0 with 0 < |d1| < 2**u
    would put R d1 within 2**u of 0 modulo P; and the three-unit patterns above."""
    lim = 1 << unit_bits
    for d1 in range(1, lim):
        x = C.ROOT * d1 % P
        assert lim <= x <= P - lim, d1
    assert _three_units_clear(unit_bits, burst)


def _reference(t: torch.Tensor) -> int:
    raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    units = list(raw) if t.element_size() == 1 else [int(v) for v in
                                                      np.frombuffer(raw, dtype="<i2")]
    return sum(u * pow(C.ROOT, j, P) for j, u in enumerate(units)) % P


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.uint8])
def test_every_single_bit_flip_is_detected(dtype):
    t = (torch.randn(40, generator=torch.Generator().manual_seed(0)) * 50).to(dtype)
    base = C.tensor_hash(t)
    assert base == _reference(t)
    raw = t.view(torch.uint8).clone()
    for bit in range(raw.numel() * 8):
        flipped = raw.clone()
        flipped[bit // 8] ^= 1 << (bit % 8)
        assert C.tensor_hash(flipped.view(dtype)) != base, bit


def _flip(t: torch.Tensor, bits) -> torch.Tensor:
    raw = t.view(torch.uint8).clone()
    for bit in bits:
        raw[bit // 8] ^= 1 << (bit % 8)
    return raw.view(t.dtype)


def test_two_bit_errors_near_and_far_and_bursts_are_detected():
    g = torch.Generator().manual_seed(1)
    t = torch.randn(300_000, generator=g).to(torch.bfloat16)  # 600 KB: rows, tail, far pairs
    base = C.tensor_hash(t)
    rng = random.Random(0)
    n_bits = t.numel() * 16
    for _ in range(40):
        i = rng.randrange(n_bits)
        j = rng.choice([i + rng.randint(1, 64), rng.randrange(n_bits)]) % n_bits
        if i != j:
            assert C.tensor_hash(_flip(t, [i, j])) != base, (i, j)
    for _ in range(40):
        length = rng.randint(2, 32)
        start = rng.randrange(n_bits - length)
        inner = [start + k for k in range(1, length - 1) if rng.random() < 0.5]
        assert C.tensor_hash(_flip(t, [start, *inner, start + length - 1])) != base


def test_a_negated_pair_and_a_swap_are_detected():
    t = torch.randn(64, 64, generator=torch.Generator().manual_seed(2))
    negated = t.clone()
    negated.view(-1)[[5, 7]] *= -1  # the pair that the sums modulo 2**32 could not see
    swapped = t.clone()
    swapped.view(-1)[[5, 6]] = t.view(-1)[[6, 5]]
    assert len({C.tensor_hash(t), C.tensor_hash(negated), C.tensor_hash(swapped)}) == 3


def test_boxes_of_a_chunk_add_up_and_match_on_strided_views():
    """The shares of disjoint boxes (strided views, as a load at another world size reads)
    add up modulo P to the whole chunk's checksum; int64 elements are four units each."""
    for dtype in (torch.float32, torch.int64, torch.bfloat16):
        t = (torch.randn(9, 70, 3, generator=torch.Generator().manual_seed(3)) * 1e3).to(dtype)
        whole = C.tensor_hash(t)
        assert whole == _reference(t)
        total = 0
        for r0, r1 in ((0, 4), (4, 9)):
            for c0, c1 in ((0, 33), (33, 70)):
                total += int(C.box_hash(t[r0:r1, c0:c1], t.shape, [r0, c0, 0]))
        assert total % P == whole
        assert int(C.box_hash(t.transpose(0, 1), (70, 9, 3))) == _reference(
            t.transpose(0, 1).contiguous())


def test_mulmod_and_sum_mod_equal_python_integers():
    rng = random.Random(5)
    xs = [rng.randrange(P) for _ in range(500)] + [0, 1, P - 1]
    ys = [rng.randrange(P) for _ in range(500)] + [P - 1, P - 1, P - 1]
    got = C.mulmod(torch.tensor(xs), torch.tensor(ys)).tolist()
    assert got == [x * y % P for x, y in zip(xs, ys)]
    assert int(C.sum_mod(torch.tensor(xs))) == sum(xs) % P
