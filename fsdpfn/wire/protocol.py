"""The wire and disk formats that push_weights (trainer) and fsdpfn.rollout (receiver) both speak.

Nothing here talks to a network or a process group: dtype names, the flat-bucket byte layout, the
weights checksum, the disk manifest, and the stateless process group that a trainer rank and its
receivers build from a TCPStore (outside the trainer's default world).

Flat bucket ("load_format": "flattened_bucket"): one uint8 buffer per bucket; tensor i occupies
``nbytes_i`` bytes at ``offset_i``, offsets rounded up to ALIGN (4096) bytes so every slice can be
viewed as its dtype and every 4 KiB row of the buffer belongs to one tensor (the bucket checksum
hashes rows). Both ends compute the layout from the advertised (names, dtypes, shapes) alone.

Weights checksum: each tensor's bytes hashed by fsdpfn.wire.checksum (the checkpoints' content
checksum: a polynomial over 16-bit units modulo 2**61 - 1 that detects every 1- and 2-bit error
and every burst of up to 32 bits, and sees the order of the words), bit-exact on any device. A
flat bucket is hashed row by row (each 4 KiB row against the powers of its positions, one Triton
pass on CUDA), the rows weighted by their position and summed per tensor with a prefix sum. The
checksums of all tensors combine over names in sorted order as sum(rank * c) mod 2**61 - 1
(checksum.combine). The trainer computes it from what it sends, the receiver from what it serves
after the swap, and equality shows the server really holds the pushed weights, in the pushed
order.
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

from fsdpfn.wire import checksum

__all__ = ["ALIGN", "DTYPES", "dtype_from_name", "dtype_name", "bucket_layout", "tensor_checksum",
           "tensor_checksums", "word_sums", "padded_size", "flat_checksums", "zero_padding",
           "combine_checksums", "checksum_ranks", "combine_on_device", "MANIFEST", "write_manifest",
           "read_manifest", "sha256_of",
           "make_group", "broadcast", "wait_work", "DEFAULT_BUCKET_BYTES", "DEFAULT_EDGE_BYTES"]

ALIGN = 4096  # a row of the bucket checksum: long rows make its row sums bandwidth-bound
DEFAULT_BUCKET_BYTES = 1 << 30
DEFAULT_EDGE_BYTES = 256 << 20  # the first and last buckets of a push (see plan_buckets)
MANIFEST = "fsdpfn_manifest.json"

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


_ROW = ALIGN // 2  # 16-bit units in a row of a flat bucket


def _byte_units(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` as 16-bit units (bytes when their count is odd), 1-D."""
    raw = t.detach().contiguous().view(-1).view(torch.uint8)
    return raw.view(torch.int16) if raw.numel() % 2 == 0 else raw


def _unsigned(value: int) -> int:
    return int(value) % (1 << 64)


def tensor_checksum(t: torch.Tensor) -> int:
    """The checksum (fsdpfn.wire.checksum) of the bytes of ``t`` (any device), in [0, 2**61-1)."""
    return int(checksum.box_hash(_byte_units(t)).item())


def word_sums(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """tensor_checksum of each, as one int64 tensor on the first one's device, not read (no
    synchronisation)."""
    return torch.stack([checksum.box_hash(_byte_units(t)).to(tensors[0].device)
                        for t in tensors])


def tensor_checksums(tensors: Sequence[torch.Tensor]) -> list[int]:
    """tensor_checksum of each, with one device synchronisation for all of them."""
    return [int(v) for v in word_sums(tensors).tolist()] if tensors else []


def padded_size(nbytes: int) -> int:
    """Bytes allocated for a flat bucket of ``nbytes``: rounded up to ALIGN, the tail zero (only
    the first ``nbytes`` travel)."""
    return -(-int(nbytes) // ALIGN) * ALIGN


def flat_checksums(buf: torch.Tensor, offsets: Sequence[int],
                   sizes: Sequence[int]) -> torch.Tensor:
    """tensor_checksum of every tensor of a flat bucket at once: an int64 tensor on buf's device
    (no synchronisation). ``buf`` is the padded uint8 buffer (``padded_size`` bytes) whose padding
    bytes are zero. Offsets are ALIGN-aligned, so every ALIGN-byte row belongs to one tensor: each
    row is hashed against the powers R**j of its own positions (one pass; checksum.row_hashes),
    weighted by R**(units before it in its tensor) (cached per layout), and each tensor's rows
    are summed as a difference of prefix sums. Tensors whose size is odd are hashed as
    bytes (as tensor_checksum does), one by one."""
    if buf.numel() % ALIGN:
        raise ValueError(f"buf: must hold a multiple of {ALIGN} bytes, got {buf.numel()}")
    weights, starts, ends = _row_layout(tuple(offsets), tuple(sizes), str(buf.device))
    rows = buf[:weights.numel() * ALIGN].view(torch.int16).view(-1, _ROW)
    low, high = checksum.weighted_rows(rows, weights)
    zero = low.new_zeros(1)
    low = torch.cat([zero, low.cumsum(0)])  # prefix sums of the 31-bit and 30-bit halves
    high = torch.cat([zero, high.cumsum(0)])
    packed = checksum.join_halves(low[ends] - low[starts], high[ends] - high[starts])
    for i, (o, n) in enumerate(zip(offsets, sizes)):
        if n % 2:
            packed[i] = checksum.box_hash(buf[o:o + n])
    return packed


@functools.lru_cache(maxsize=256)
def _row_layout(offsets: tuple, sizes: tuple, device: str) -> tuple[torch.Tensor, ...]:
    """R**(the units of its tensor before it) for each ALIGN-byte row of a bucket, and the first
    and one-past-last row of each tensor, on ``device``, cached per layout: a push repeats the
    same layouts, and building them anew would cost a host-device copy (and a synchronisation)
    per bucket; they take 1/512 of the bucket's bytes."""
    starts = [o // ALIGN for o in offsets]
    ends = [-(-(o + n) // ALIGN) for o, n in zip(offsets, sizes)]
    local = torch.zeros(max(ends, default=0), dtype=torch.int64)
    for first, end in zip(starts, ends):
        local[first:end] = torch.arange(end - first)
    table = checksum.powers(pow(checksum.ROOT, _ROW, checksum.P), max(1, local.numel()), "cpu")
    return tuple(t.to(device) for t in (table[local], torch.tensor(starts, dtype=torch.int64),
                                         torch.tensor(ends, dtype=torch.int64)))


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
    """checksum.combine of the tensors' checksums over names in sorted order (rank 1-based):
    sum(rank * c) mod 2**61 - 1; ``c`` may be given as the signed int64 bit pattern (what a
    device tensor's tolist() holds)."""
    values = [_unsigned(c) % checksum.P for _, c in sorted(per_tensor.items())]
    ranks = torch.arange(1, len(values) + 1, dtype=torch.int64)
    return int(checksum.combine(torch.tensor(values, dtype=torch.int64), ranks))


@functools.lru_cache(maxsize=64)
def checksum_ranks(names: tuple[str, ...], device: str) -> torch.Tensor:
    """The 1-based position of each name in sorted order, an int64 tensor on ``device`` (cached
    per list of names): the weights of combine_checksums."""
    ranks = [0] * len(names)
    for position, i in enumerate(sorted(range(len(names)), key=names.__getitem__)):
        ranks[i] = position + 1
    return torch.tensor(ranks, dtype=torch.int64).to(device)


def combine_on_device(sums: torch.Tensor, names: Sequence[str]) -> torch.Tensor:
    """combine_checksums({names[i]: sums[i]}) on sums' device, as a 0-d int64 tensor, not read."""
    return checksum.combine(sums, checksum_ranks(tuple(names), str(sums.device)))


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
               group_name: str, backend: str, timeout_s: float, device: torch.device | None = None):
    """Member ``rank`` of a weights-update group formed as SGLang's ``init_custom_process_group``
    forms it, so that a trainer and a server built either way meet: the TCPStore that torch's
    ``rendezvous("tcp://addr:port", rank, world_size)`` builds (rank 0 hosts it, multi-tenant,
    and waits for every member to check in), ``PrefixStore(group_name, store)``, then the
    prefixes torch's ``_new_process_group_helper`` adds (``"{group_name}/"``, then ``"cpu/"``
    for gloo or ``"cuda/"`` for NCCL). The store is built here rather than by ``rendezvous``,
    which under torchrun makes every rank, rank 0 too, a client of the agent's store. The group
    is built from those stores directly: not part of torch.distributed's default world, nothing
    registered, nothing to destroy but the object. Returns (store, backend object). Blocks until
    every member joined or ``timeout_s`` passes.
    """
    from torch.distributed import PrefixStore, TCPStore

    timeout = datetime.timedelta(seconds=float(timeout_s))
    store = TCPStore(master_address, int(master_port), int(world_size), is_master=(rank == 0),
                     timeout=timeout, multi_tenant=True)
    helper = PrefixStore(f"{group_name}/", PrefixStore(group_name, store))
    if backend == "gloo":
        from torch.distributed import ProcessGroupGloo

        opts = ProcessGroupGloo._Options()  # noqa: SLF001 - the only way to pass both options
        opts._timeout = timeout  # noqa: SLF001
        host = master_address if rank == 0 else _local_address(master_address)
        opts._devices = [ProcessGroupGloo.create_device(hostname=host)]  # noqa: SLF001
        pg = ProcessGroupGloo(PrefixStore("cpu/", helper), int(rank), int(world_size), opts)
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
        pg = ProcessGroupNCCL(PrefixStore("cuda/", helper), int(rank), int(world_size), opts)
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
