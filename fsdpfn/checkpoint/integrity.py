"""Checkpoint integrity: a checksum of every chunk DCP saves, verified when it is loaded.

Chunk checksum. A DCP chunk is a box of a tensor (a rank's local shard). Its checksum is the
content checksum of fsdpfn.wire.checksum (the one the weights push uses): the chunk's bytes in
row-major order, read as 16-bit units (bytes for 1-byte dtypes), as a polynomial in a fixed root
R modulo the prime 2**61 - 1. It detects every 1- and 2-bit error, every error within one unit
and every burst of up to 32 bits (see that module for the reasons), and it is exact: a chunk
hashed on a GPU at save matches the same chunk hashed on a CPU at load. The weight of each unit
splits along the box's dims, so the share of any sub-box of a chunk is computed from the box
alone and the shares of disjoint boxes add up (modulo the prime) to the chunk's checksum: a load
at another world size, where a rank reads parts of saved chunks, completes each chunk's checksum
with one all-reduce.

Where it runs. Save: every rank hashes the chunks it hands to DCP, on the device, before DCP
stages or writes anything (``local_checksums``); rank 0 gathers them and records them in the
manifest with a CRC32 of the small items DCP pickles (optimizer hyper-parameters), of
``.metadata`` and of the RNG files (``record``). Load: DCP copies every saved chunk (or the part
of it a rank needs) into the staging buffers; ``VerifyingPlanner.commit_tensor`` hashes each such
box there, on the device, as it lands, and ``load_bytes`` checks the pickled items' CRC before
unpickling them. After the read, ``verify`` adds the shares of every saved chunk over the ranks
(each box counted once, replicas skipped) and compares them with the record. So every byte the
load uses is checked, at any world size, without reading any file twice. A chunk DCP cannot even
deserialise (a truncated or zeroed file) is reported by ``NamingReader`` with the file's name.
"""

from __future__ import annotations

import dataclasses
import math
import re
import zlib
from pathlib import Path
from typing import Iterable, Sequence

import torch
import torch.distributed as dist
from torch.futures import Future
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType

import fsdpfn.agree as agree
from fsdpfn.errors import CheckpointError
from fsdpfn.wire import checksum

__all__ = ["ALGORITHM", "box_hash", "local_checksums", "record", "file_crc", "check_file",
           "VerifyingPlanner", "NamingReader", "local_shares", "verify"]

ALGORITHM = checksum.ALGORITHM
_FN = "load_checkpoint"
_M31 = (1 << 31) - 1


# ---------------------------------------------------------------- the checksum


def box_hash(box: torch.Tensor, chunk_sizes: Sequence[int],
             box_offsets: Sequence[int] | None = None) -> torch.Tensor:
    """The checksum's share (int64, 0-d, in [0, 2**61 - 1)) of ``box``, a sub-box at
    ``box_offsets`` of a chunk of ``chunk_sizes`` (the whole chunk by default), on ``box``'s
    device, not read (no sync)."""
    if box.is_complex() or box.element_size() not in (1, 2, 4, 8):
        raise CheckpointError(f"save_checkpoint: tensor dtype: must have 1, 2, 4 or 8-byte real "
                              f"elements to be checksummed, got {box.dtype}")
    return checksum.box_hash(box, list(chunk_sizes), box_offsets)


def _to_lists(sums: list[torch.Tensor]) -> list[list[int]]:
    """Read device sums with one synchronisation per device."""
    out: list = [None] * len(sums)
    by_device: dict = {}
    for i, s in enumerate(sums):
        by_device.setdefault(s.device, []).append(i)
    for indices in by_device.values():
        values = torch.stack([sums[i] for i in indices]).tolist()
        for i, v in zip(indices, values):
            out[i] = v
    return out


# ---------------------------------------------------------------- save


def local_checksums(state_dict: dict) -> list[tuple[str, list[int], int]]:
    """``(key, chunk offsets, checksum)`` of every tensor chunk this rank hands to DCP for
    ``state_dict`` (the chunks DCP's own planner makes: DTensors' local shards, whole plain
    tensors), hashed where they live."""
    planner = DefaultSavePlanner()
    planner.set_up_planner(state_dict, None, True)
    items = [i for i in planner.create_local_plan().items if i.type != WriteItemType.BYTE_IO]
    sums = [box_hash(planner.resolve_data(i), i.tensor_data.chunk.sizes) for i in items]
    values = _to_lists(sums)
    return [(i.index.fqn, [int(o) for o in i.index.offset], h) for i, h in zip(items, values)]


def file_crc(path: Path, offset: int = 0, length: int | None = None) -> int:
    with open(path, "rb") as f:
        f.seek(offset)
        crc, left = 0, length
        while left is None or left > 0:
            block = f.read(1 << 24 if left is None else min(left, 1 << 24))
            if not block:
                break
            crc = zlib.crc32(block, crc)
            if left is not None:
                left -= len(block)
    return crc


def _writer_rank(relative_path: str) -> int | None:
    match = re.match(r"__(\d+)_", relative_path)  # FileSystemWriter names files __<rank>_<i>
    return int(match[1]) if match else None


def _pickled_crcs(root: Path, metadata) -> dict[str, int]:
    """CRC32 of every pickled (non-tensor) item's bytes, each file opened once."""
    per_file: dict[str, list] = {}
    for index, info in metadata.storage_data.items():
        if isinstance(metadata.state_dict_metadata[index.fqn], BytesStorageMetadata):
            per_file.setdefault(info.relative_path, []).append((info.offset, info.length,
                                                                index.fqn))
    out = {}
    for rel, items in per_file.items():
        with open(root / rel, "rb") as f:
            for offset, length, key in sorted(items):
                f.seek(offset)
                out[key] = zlib.crc32(f.read(length))
    return out


def record(root: Path, gathered: Sequence[Sequence], small_files: Iterable[str]) -> dict:
    """The manifest's ``checksums`` (rank 0, once every rank's data is written): the chunk
    checksums of every rank (``gathered[r]`` from rank r's local_checksums; of replicated chunks,
    the writer's), the CRC32 of every pickled item in the .distcp files, and of ``small_files``."""
    metadata = FileSystemReader(str(root)).read_metadata()
    sums: dict = {}
    for rank, entries in enumerate(gathered):
        for key, offsets, value in entries:
            where = (key, tuple(offsets))
            info = metadata.storage_data.get(MetadataIndex(key, torch.Size(offsets)))
            if where not in sums or (info is not None
                                     and _writer_rank(info.relative_path) == rank):
                sums[where] = value
    chunks: dict = {}
    pickled = _pickled_crcs(root, metadata)
    for index, info in metadata.storage_data.items():
        if isinstance(metadata.state_dict_metadata[index.fqn], BytesStorageMetadata):
            continue
        where = (index.fqn, tuple(int(o) for o in index.offset))
        if where not in sums:
            raise CheckpointError(f"save_checkpoint: {index.fqn!r}: every saved chunk must have "
                                  f"been checksummed, got none for the chunk at offsets "
                                  f"{list(where[1])} in {info.relative_path!r}")
        chunks.setdefault(index.fqn, []).append([list(where[1]), sums[where]])
    files = {rel: file_crc(root / rel) for rel in sorted(small_files)}
    return {"algorithm": ALGORITHM, "chunks": dict(sorted(chunks.items())),
            "bytes": dict(sorted(pickled.items())), "files": files}


# ---------------------------------------------------------------- load


def check_file(root: Path, rel: str, checksums: dict | None, fn: str = _FN) -> None:
    """CRC32 of a whole small file (``.metadata``, an RNG file) against the record; ``fn``: the
    public function the error names."""
    if checksums is None or rel not in checksums.get("files", {}):
        return
    expected, actual = checksums["files"][rel], file_crc(root / rel)
    if actual != expected:
        raise CheckpointError(f"{fn}: {str(root / rel)!r}: its CRC32 must be {expected} as "
                              f"saved, got {actual}: the file is corrupted")


def _chunk_file(metadata, key: str, offsets) -> str:
    index = MetadataIndex(key, torch.Size(offsets) if offsets is not None else None)
    info = metadata.storage_data.get(index)
    return info.relative_path if info is not None else "?"


class VerifyingPlanner(DefaultLoadPlanner):
    """DCP's default load planner that checks every pickled item's CRC before unpickling it and
    hashes every tensor box right after DCP copied it into the staging buffer (``shares``)."""

    def __init__(self, root: Path, checksums: dict):
        super().__init__()
        self.root, self.checksums = root, checksums
        self.shares: dict[tuple, torch.Tensor] = {}

    def load_bytes(self, read_item, value) -> None:
        key = read_item.storage_index.fqn
        expected = self.checksums.get("bytes", {}).get(key)
        actual = zlib.crc32(value.getbuffer())
        if expected != actual:
            file = self.root / _chunk_file(self.metadata, key, None)
            raise CheckpointError(f"{_FN}: {str(file)!r}: the item {key!r} must have the CRC32 "
                                  f"{expected} recorded at save, got {actual}: the file is "
                                  f"corrupted")
        super().load_bytes(read_item, value)

    def commit_tensor(self, read_item, tensor: torch.Tensor) -> None:
        index = read_item.storage_index
        sizes = self._sizes(index)
        box = (index.fqn, tuple(int(o) for o in index.offset),
               tuple(int(o) for o in read_item.storage_offsets),
               tuple(int(n) for n in read_item.lengths))
        self.shares[box] = box_hash(tensor, sizes, read_item.storage_offsets)

    def _sizes(self, index) -> Sequence[int]:
        for chunk in self.metadata.state_dict_metadata[index.fqn].chunks:
            if tuple(chunk.offsets) == tuple(index.offset):
                return chunk.sizes
        raise CheckpointError(f"{_FN}: key {index.fqn!r}: must have a chunk at offsets "
                              f"{list(index.offset)} in the DCP metadata, got none")


class NamingReader(FileSystemReader):
    """DCP's file reader, reading one file at a time so that a file it cannot deserialise (torch's
    loader failing on a truncated or zeroed file) is named, with the item it was reading."""

    def read_data(self, plan, planner):
        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path,
                                []).append(item)
        for rel, items in per_file.items():
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except CheckpointError:
                raise
            except Exception as exc:  # noqa: BLE001 - torch's loader: any error is a bad file
                raise self._named(plan, rel, items, planner, exc) from None
        done: Future = Future()
        done.set_result(None)
        return done

    def _named(self, plan, rel: str, items: list, planner, exc: BaseException
               ) -> CheckpointError:
        culprit = items[0]
        for item in items:  # the error path only: find the first item that fails on its own
            try:
                super().read_data(dataclasses.replace(plan, items=[item]), planner).wait()
            except Exception:  # noqa: BLE001
                culprit = item
                break
        where = culprit.storage_index
        what = (f"the item {where.fqn!r}" if culprit.type == LoadItemType.BYTE_IO
                else f"the chunk of {where.fqn!r} at offsets {list(where.offset)}")
        text = " ".join(ln.strip() for ln in str(exc).splitlines() if ln.strip())
        detail = f"{type(exc).__name__}: {'. '.join(text.split('. ')[:2])[:300]}"
        return CheckpointError(f"{_FN}: {str(Path(self.path) / rel)!r}: {what} must be readable "
                               f"as saved, got {detail}: the file is truncated or corrupted")


def _expected(checksums: dict) -> dict:
    return {(key, tuple(offsets)): value
            for key, entries in checksums.get("chunks", {}).items()
            for offsets, value in entries}


def local_shares(planner: VerifyingPlanner) -> tuple[list, list]:
    """This rank's boxes (sorted) and their checksum shares, read from the device at once."""
    mine = sorted(planner.shares)
    return mine, _to_lists([planner.shares[b] for b in mine])


def verify(local: tuple[list, list], planner: VerifyingPlanner, root: Path
           ) -> CheckpointError | None:
    """Collective (every rank, default group): add up the shares of every saved chunk that was
    read (``local`` from local_shares; each box once, whichever ranks read it) and compare with
    the record. The same verdict on every rank: None, or a CheckpointError naming the file and
    the tensor."""
    mine, values = local
    world, rank = agree.world_size(), agree.rank()
    every = [mine]
    if world > 1:
        every = [None] * world
        dist.all_gather_object(every, mine)
    owner: dict = {}
    for r, boxes in enumerate(every):
        for box in boxes:
            owner.setdefault(box, r)
    chunks = sorted({box[:2] for box in owner})
    row = {chunk: i for i, chunk in enumerate(chunks)}
    acc = torch.zeros(len(chunks), 3, dtype=torch.int64)  # low 31 bits, high 30 bits, volume
    for box, value in zip(mine, values):
        if owner[box] == rank:
            acc[row[box[:2]]] += torch.tensor([value & _M31, value >> 31, math.prod(box[3])])
    if world > 1:
        dist.all_reduce(acc)
    unread = _unread(planner, set(chunks))
    if unread:
        key, offsets = unread[0]
        return CheckpointError(f"{_FN}: {str(root / _chunk_file(planner.metadata, key, offsets))!r}"
                               f": the chunk of tensor {key!r} at offsets {list(offsets)} must "
                               f"have been read and checked, got no read of it "
                               f"({len(unread)} such chunks)")
    return _compare(chunks, acc, _expected(planner.checksums), planner.metadata, root)


def _unread(planner: VerifyingPlanner, read: set) -> list[tuple]:
    """The non-empty saved chunks of the keys being loaded that no rank read (none, unless DCP
    skipped a read: then nothing may pass unverified)."""
    out = []
    for key in sorted(planner.state_dict):
        md = planner.metadata.state_dict_metadata.get(key)
        for chunk in getattr(md, "chunks", ()):
            where = (key, tuple(int(o) for o in chunk.offsets))
            if math.prod(chunk.sizes) > 0 and where not in read:
                out.append(where)
    return out


def _compare(chunks, acc, expected, metadata, root) -> CheckpointError | None:
    bad = []
    for (key, offsets), (low, high, volume) in zip(chunks, acc.tolist()):
        value = (low + (high << 31)) % checksum.P
        sizes = next(c.sizes for c in metadata.state_dict_metadata[key].chunks
                     if tuple(c.offsets) == offsets)
        if volume != math.prod(sizes):
            bad.append((key, offsets, f"all {math.prod(sizes)} elements read and checked, got "
                                      f"{volume}"))
        elif (key, offsets) not in expected:
            bad.append((key, offsets, "a checksum recorded at save, got none"))
        elif expected[(key, offsets)] != value:
            bad.append((key, offsets, f"the checksum {expected[(key, offsets)]} recorded at "
                                      f"save, got {value}"))
    if not bad:
        return None
    key, offsets, rule = bad[0]
    file = root / _chunk_file(metadata, key, offsets)
    more = f" ({len(bad) - 1} more chunks differ)" if len(bad) > 1 else ""
    return CheckpointError(f"{_FN}: {str(file)!r}: the chunk of tensor {key!r} at offsets "
                           f"{list(offsets)} must have {rule}: the file is corrupted{more}")
