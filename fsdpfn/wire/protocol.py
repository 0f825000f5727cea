"""The wire and disk formats that push_weights (trainer) and fsdpfn.rollout (receiver) both speak.

Nothing here talks to a network or a process group: dtype names, the flat-bucket byte layout, the
weights checksum, the disk manifest, and the stateless process group that a trainer rank and its
receivers build from a TCPStore (outside the trainer's default world).

Flat bucket ("load_format": "flattened_bucket"): one uint8 buffer per bucket; tensor i occupies
``nbytes_i`` bytes at ``offset_i``, offsets rounded up to ALIGN (4096) bytes so every slice can be
viewed as its dtype and every 4 KiB row of the buffer belongs to one tensor (the bucket checksum
sums rows). Both ends compute the layout from the advertised (names, dtypes, shapes) alone.

Weights checksum (order-sensitive). The bytes of a tensor, read as little-endian int32 words
w_0..w_{n-1} (uint8 bytes when the byte count is not a multiple of 4), give two sums modulo 2**32::

    S = sum(w_j)            W = sum((j + 1) * w_j)

and the tensor's checksum is the 64-bit integer S + 2**32 * W (an int64 bit pattern on a device).
A changed word changes S; a permutation of unequal words inside the tensor keeps S and changes W
(the position weights see the order). Integer sums modulo 2**32 are associative (int32 additions
wrap), so the value is bit-exact whatever the device or reduction order. W needs no position
tensor: each 4 KiB row of 1024 words is read as a [32, 32] block, and its two marginals (sums
over each axis, two reductions at memory speed, both 1/32 of the data) give the row's sum and its
column-weighted sum; the row weights are applied to those small vectors (see ``_row_terms``).
The checksums of all tensors combine over names in sorted order as sum(rank * c) mod 2**61 - 1.
The trainer computes it from what it sends, the receiver from what it serves after the swap, and
equality shows the server really holds the pushed weights, in the pushed order.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import json
import math
import time
from pathlib import Path
from typing import Sequence

import torch

from fsdpfn.wire import fused

__all__ = ["ALIGN", "DTYPES", "dtype_from_name", "dtype_name", "bucket_layout", "tensor_checksum",
           "tensor_checksums", "word_sums", "padded_size", "flat_checksums", "zero_padding",
           "combine_checksums", "checksum_ranks", "combine_on_device", "MANIFEST", "write_manifest", "read_manifest", "sha256_of",
           "make_group", "broadcast", "wait_work", "DEFAULT_BUCKET_BYTES", "DEFAULT_EDGE_BYTES"]

ALIGN = 4096  # a row of the bucket checksum: long rows make its row sums bandwidth-bound
DEFAULT_BUCKET_BYTES = 1 << 30
DEFAULT_EDGE_BYTES = 256 << 20  # the first and last buckets of a push (see plan_buckets)
MANIFEST = "fsdpfn_manifest.json"
_MOD = (1 << 61) - 1

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "float64": torch.float64}


def dtype_from_name(name: str) -> torch.dtype:
    """'bfloat16' or 'torch.bfloat16' -> torch.bfloat16; ValueError for anything else."""
    key = str(name).removeprefix("torch.")
    if key not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[key]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def nbytes_of(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(int(d) for d in shape) * dtype.itemsize


def bucket_layout(dtypes: Sequence[str], shapes: Sequence[Sequence[int]]) -> tuple[list[int], int]:
    """(offsets, total bytes) of a flat bucket holding tensors of these dtypes and shapes."""
    offsets, cursor = [], 0
    for name, shape in zip(dtypes, shapes):
        cursor = -(-cursor // ALIGN) * ALIGN
        offsets.append(cursor)
        cursor += nbytes_of(shape, dtype_from_name(name))
    return offsets, cursor


_WRAP = 1 << 32
_ROW = ALIGN // 4  # int32 words in a row of a flat bucket
_SIDE = 32  # a row read as a [_SIDE, _SIDE] block: _SIDE ** 2 == _ROW


def _mulmod32(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x * y mod 2**32 for int64 tensors in [0, 2**32), without int64 overflow."""
    return ((x * (y >> 16) % _WRAP) * 65536 + x * (y & 0xFFFF)) % _WRAP


def _row_terms(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum, column-weighted sum) of each row of int32 ``rows`` [R, _ROW], int64 [R] mod 2**32.

    A row is a [32, 32] block (col = 32 * a + b): its two marginals p[a] (sum over b) and q[b]
    (sum over a) are two reductions in wrapping int32 (memory speed), and
    sum(col * w) = 32 * sum(a * p[a]) + sum(b * q[b]) is taken on them (1/32 of the data).
    On CUDA, one fused pass gives the same numbers (fsdpfn.wire.fused)."""
    done = fused.row_terms(rows)
    if done is not None:
        return done
    block = rows.view(-1, _SIDE, _SIDE)
    p = block.sum(2, dtype=torch.int32).to(torch.int64)
    q = block.sum(1, dtype=torch.int32).to(torch.int64)
    position = torch.arange(_SIDE, dtype=torch.int64, device=rows.device)
    sums = p.sum(1) % _WRAP
    weighted = (_SIDE * (p * position).sum(1) + (q * position).sum(1)) % _WRAP
    return sums, weighted


def _direct(words: torch.Tensor, first: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(S, W) of 1-D integer ``words`` whose first one has position ``first`` (0-based), with an
    explicit position tensor (short tails and byte-summed tensors only)."""
    w = words.to(torch.int64) % _WRAP
    weights = torch.arange(first + 1, first + 1 + w.numel(), dtype=torch.int64,
                           device=w.device) % _WRAP
    return w.sum() % _WRAP, _mulmod32(w, weights).sum() % _WRAP


def _pack(sums: torch.Tensor, weighted: torch.Tensor) -> torch.Tensor:
    """S + 2**32 * W as the bit pattern of an int64 (S, W in [0, 2**32))."""
    high = torch.where(weighted >= 1 << 31, weighted - _WRAP, weighted)
    return sums + high * _WRAP


def _word_sum(t: torch.Tensor) -> torch.Tensor:
    """The checksum of one tensor (module doc) as a packed int64 0-d tensor, not read."""
    raw = t.detach().contiguous().view(-1).view(torch.uint8)
    if raw.numel() % 4:
        return _pack(*_direct(raw, 0))
    words = raw.view(torch.int32)
    full = words.numel() // _ROW * _ROW
    sums, weighted = _direct(words[full:], full)
    if full:
        row_sums, row_weighted = _row_terms(words[:full].view(-1, _ROW))
        bases = torch.arange(full // _ROW, dtype=torch.int64, device=words.device) * _ROW + 1
        sums = (sums + row_sums.sum()) % _WRAP
        weighted = (weighted + (_mulmod32(bases % _WRAP, row_sums) + row_weighted).sum()) % _WRAP
    return _pack(sums, weighted)


def _unsigned(value: int) -> int:
    return int(value) % (1 << 64)


def tensor_checksum(t: torch.Tensor) -> int:
    """Order-sensitive, bit-exact checksum S + 2**32 * W of the bytes of ``t`` (any device)."""
    return _unsigned(_word_sum(t).item())


def word_sums(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """tensor_checksum of each, as one int64 tensor (bit patterns) on the first one's device,
    not read (no synchronisation)."""
    return torch.stack([_word_sum(t).to(tensors[0].device) for t in tensors])


def tensor_checksums(tensors: Sequence[torch.Tensor]) -> list[int]:
    """tensor_checksum of each, with one device synchronisation for all of them."""
    return [_unsigned(v) for v in word_sums(tensors).tolist()] if tensors else []


def padded_size(nbytes: int) -> int:
    """Bytes allocated for a flat bucket of ``nbytes``: rounded up to ALIGN, the tail zero (only
    the first ``nbytes`` travel)."""
    return -(-int(nbytes) // ALIGN) * ALIGN


def flat_checksums(buf: torch.Tensor, offsets: Sequence[int],
                   sizes: Sequence[int]) -> torch.Tensor:
    """tensor_checksum of every tensor of a flat bucket at once: an int64 tensor (bit patterns)
    on buf's device (no synchronisation). ``buf`` is the padded uint8 buffer (``padded_size``
    bytes) whose padding bytes are zero. Offsets are ALIGN-aligned, so every ALIGN-byte row
    belongs to one tensor: per row, its sum and its sum weighted by the global word position
    (two reductions of the whole buffer in wrapping int32, at the memory's speed; _row_terms),
    then one prefix sum each and a difference per tensor; a tensor's own positions are the
    global ones shifted by its first word. Tensors whose size is not a multiple of 4 bytes are
    summed as uint8 (as tensor_checksum does), one by one."""
    if buf.numel() % ALIGN:
        raise ValueError(f"buf: must hold a multiple of {ALIGN} bytes, got {buf.numel()}")
    row_sums, row_weighted = _row_terms(buf.view(torch.int32).view(-1, _ROW))
    firsts = torch.arange(row_sums.numel(), dtype=torch.int64, device=buf.device) * _ROW
    global_weighted = (_mulmod32(firsts % _WRAP, row_sums) + row_weighted) % _WRAP
    zero = row_sums.new_zeros(1)
    prefix_s = torch.cat([zero, row_sums.cumsum(0)])
    prefix_g = torch.cat([zero, global_weighted.cumsum(0)])
    del row_sums, row_weighted, global_weighted
    starts, ends = _row_bounds(tuple(offsets), tuple(sizes), str(buf.device))
    sums = (prefix_s[ends] - prefix_s[starts]) % _WRAP
    shift = (starts * _ROW - 1) % _WRAP  # position j + 1 = global word - (first word - 1)
    weighted = (prefix_g[ends] - prefix_g[starts] - _mulmod32(shift, sums)) % _WRAP
    packed = _pack(sums, weighted)
    for i, (o, n) in enumerate(zip(offsets, sizes)):
        if n % 4:
            packed[i] = _pack(*_direct(buf[o:o + n], 0))
    return packed


@functools.lru_cache(maxsize=256)
def _row_bounds(offsets: tuple, sizes: tuple, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """First and one-past-last checksum row of each tensor, on ``device``, cached per layout: a
    push repeats the same layouts, and building them anew would cost a host-device copy (and a
    synchronisation) per bucket."""
    starts = torch.tensor([o // ALIGN for o in offsets], dtype=torch.int64)
    ends = torch.tensor([-(-(o + n) // ALIGN) for o, n in zip(offsets, sizes)],
                        dtype=torch.int64)
    return starts.to(device), ends.to(device)


@functools.lru_cache(maxsize=256)
def _gap_index(offsets: tuple, sizes: tuple, device: str) -> torch.Tensor | None:
    """The byte positions of a padded bucket that belong to no tensor, on ``device`` (cached per
    layout), or None when there are none."""
    gaps = [torch.arange(o + n, padded_size(o + n)) for o, n in zip(offsets, sizes)
            if (o + n) % ALIGN]
    return torch.cat(gaps).to(device) if gaps else None


def zero_padding(buf: torch.Tensor, offsets: Sequence[int], sizes: Sequence[int]) -> None:
    """Zero the bytes of ``buf`` (padded, see padded_size) that belong to no tensor: the gap after
    each tensor up to the next ALIGN boundary (one kernel; the positions are cached per layout)."""
    index = _gap_index(tuple(offsets), tuple(sizes), str(buf.device))
    if index is not None:
        buf.index_fill_(0, index, 0)


def combine_checksums(per_tensor: dict[str, int]) -> int:
    """sum(rank * c) mod 2**61 - 1 over names in sorted order (rank 1-based); ``c`` may be given
    as the signed int64 bit pattern (what a device tensor's tolist() holds)."""
    return sum((i + 1) * (_unsigned(c) % _MOD) for i, (_, c) in
               enumerate(sorted(per_tensor.items()))) % _MOD


@functools.lru_cache(maxsize=64)
def checksum_ranks(names: tuple[str, ...], device: str) -> torch.Tensor:
    """The 1-based position of each name in sorted order, an int64 tensor on ``device`` (cached
    per list of names): the weights of combine_checksums."""
    ranks = [0] * len(names)
    for position, i in enumerate(sorted(range(len(names)), key=names.__getitem__)):
        ranks[i] = position + 1
    return torch.tensor(ranks, dtype=torch.int64).to(device)


def combine_on_device(sums: torch.Tensor, names: Sequence[str]) -> torch.Tensor:
    """combine_checksums({names[i]: sums[i]}) on sums' device, as a 0-d int64 tensor, not read.

    With c = S + 2**32 W: A = sum(rank * S), B = sum(rank * W) (each term below 2**32 times the
    rank, so exact in int64 for up to ~40k tensors), and 2**32 B = 2**61 (B >> 29) +
    2**32 (B mod 2**29), where 2**61 = 1 modulo 2**61 - 1."""
    ranks = checksum_ranks(tuple(names), str(sums.device))
    low, high = sums & (_WRAP - 1), (sums >> 32) & (_WRAP - 1)
    a = (low * ranks).sum() % _MOD
    b = (high * ranks).sum() % _MOD
    return (a + (b >> 29) + (b & ((1 << 29) - 1)) * _WRAP) % _MOD


def sha256_of(t: torch.Tensor) -> str:
    raw = t.detach().contiguous().cpu().view(-1).view(torch.uint8)
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()


# ---------------------------------------------------------------- disk manifest


def write_manifest(directory: Path, *, version: int, entries: dict[str, dict],
                   files: list[str], weights_checksum: int) -> None:
    """entries: name -> {dtype, shape, sha256, file}; written last, fsynced (it is the commit)."""
    payload = {"format": "fsdpfn-weights/1", "version": int(version), "names": list(entries),
               "tensors": entries, "files": files, "weights_checksum": int(weights_checksum)}
    path = Path(directory) / MANIFEST
    with open(path, "w") as fh:
        json.dump(payload, fh, indent=1)
        fh.flush()
        _fsync(fh)


def read_manifest(directory: Path) -> dict | None:
    path = Path(directory) / MANIFEST
    if not path.is_file():
        return None
    with open(path) as fh:
        return json.load(fh)


def _fsync(fh) -> None:
    import os

    os.fsync(fh.fileno())


# ---------------------------------------------------------------- the stateless process group


def make_group(*, master_address: str, master_port: int, rank: int, world_size: int,
               group_name: str, backend: str, timeout_s: float, device: torch.device | None = None,
               store=None):
    """A process group of ``world_size`` members built straight from a TCPStore.

    Rank 0 hosts the store (pass ``store=None`` and it is created as master). It is not part of
    torch.distributed's default world: no global registration, nothing to destroy but the object.
    Returns (store, backend object). Blocks until every member has joined or ``timeout_s`` passes.
    """
    from torch.distributed import PrefixStore, TCPStore

    timeout = datetime.timedelta(seconds=float(timeout_s))
    if store is None:
        store = TCPStore(master_address, int(master_port), int(world_size),
                         is_master=(rank == 0), timeout=timeout, wait_for_workers=False)
    prefixed = PrefixStore(f"fsdpfn/{group_name}", store)
    if backend == "gloo":
        from torch.distributed import ProcessGroupGloo

        opts = ProcessGroupGloo._Options()  # noqa: SLF001 - the only way to pass both options
        opts._timeout = timeout  # noqa: SLF001
        host = master_address if rank == 0 else _local_address(master_address)
        opts._devices = [ProcessGroupGloo.create_device(hostname=host)]  # noqa: SLF001
        pg = ProcessGroupGloo(prefixed, int(rank), int(world_size), opts)
    elif backend == "nccl":
        from torch.distributed import ProcessGroupNCCL

        if device is not None and device.type == "cuda":
            torch.cuda.set_device(device.index if device.index is not None
                                  else torch.cuda.current_device())
        opts = ProcessGroupNCCL.Options()
        # the watchdog would tear the process down on a timeout: give it a minute more than
        # wait_work's deadline, which aborts the communicator and raises instead
        opts._timeout = timeout + datetime.timedelta(seconds=60)  # noqa: SLF001
        # the wire first: the block scheduler prefers NCCL's kernels to the gathers and checks
        # that run beside them on each end
        opts.is_high_priority_stream = True
        pg = ProcessGroupNCCL(prefixed, int(rank), int(world_size), opts)
    else:
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    return store, pg


def _local_address(master_address: str) -> str:
    """The address of this host's interface that routes to ``master_address``."""
    import socket

    if master_address in ("127.0.0.1", "localhost"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((master_address, 9))  # no packet is sent for a UDP connect
        return s.getsockname()[0]


def broadcast(pg, tensor: torch.Tensor):
    """Asynchronous broadcast of ``tensor`` from member 0 over ``pg``; returns the work handle."""
    from torch.distributed import BroadcastOptions

    opts = BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    return pg.broadcast([tensor], opts)


def wait_work(work, backend: str, timeout_s: float) -> None:
    """Block the host until ``work`` completes; raise on failure or after ``timeout_s``.

    gloo's wait takes a timeout; an NCCL wait only orders CUDA streams, so it is polled."""
    if backend == "gloo":
        work.wait(datetime.timedelta(seconds=max(timeout_s, 0.001)))
        return
    deadline = time.monotonic() + timeout_s
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise TimeoutError(f"the transfer did not complete within {timeout_s:g} s")
        time.sleep(0.0005)
    work.wait()
