"""The decode loop's bookkeeping (fsdpfn/rollout/decode.py runs it): a request's rows, the host
view of an occupied slot, the per-slot device tensors the step reads and advances, the CUDA graph
capture of a step, and the small helpers of admission (distinct prompts, padding, buckets).
"""

from __future__ import annotations

import array
import logging
import threading
import time
from typing import Callable

import torch

__all__ = ["Request", "Slot", "State", "capture", "share_groups", "distinct_prompts",
           "prompt_key", "right_padded", "bucket", "MAX_STOPS"]

log = logging.getLogger("fsdpfn.rollout")

MAX_STOPS = 32  # stop token ids per request


class Request:
    def __init__(self, prompts: list[list[int]], sp, aborted: set[int] | None = None):
        self.prompts, self.sp = prompts, sp
        # what admission tells prompts apart by: their ids, so that equal prompts of requests
        # admitted together (a workflow's episodes of one data row) are prefilled once. As
        # bytes (the engine checked each id is in [0, vocab)): hashed once, compared by memcmp
        self.keys = [array.array("q", p).tobytes() for p in prompts]
        self.rows = [(i, j) for i in range(len(prompts)) for j in range(sp.n)]  # prompt-major
        self.next_row = 0
        # rows the engine's abort marked (shared with it; read by the scheduler), and the
        # queued ones already answered "abort" (admission skips them)
        self.aborted = set() if aborted is None else aborted
        self.resolved: set[int] = set()
        self.results: list[dict | None] = [None] * len(self.rows)
        self.remaining = len(self.rows)
        self.error: BaseException | None = None
        self.done = threading.Event()


class Slot:
    """Host view of one occupied slot."""

    def __init__(self, request: Request, row: int, prompt_len: int, version: int):
        self.request, self.row = request, row
        self.prompt_len = prompt_len
        self.gen = 1  # tokens generated so far (the first comes from the prefill)
        self.segments = [(0, version)]  # (first token index, weights version)
        self.truncate = request.sp.top_p < 1 or request.sp.top_k > 0
        self.seeded = request.sp.seed is not None
        self.share: tuple | None = None  # (key, length): slots of one key share that prefix

    def bound(self, steps: int) -> int:
        """An upper bound of the attended length after ``steps`` more steps."""
        return min(self.prompt_len + self.gen - 1 + steps, self.prompt_len
                   + self.request.sp.max_new_tokens) + 1


class State:
    """Per-slot device tensors the step reads and advances (static: graphs capture them)."""

    def __init__(self, slots: int, max_len: int, device):
        def z(*shape, dtype=torch.long):
            return torch.zeros(shape, dtype=dtype, device=device)
        self.tok, self.pos, self.gen, self.max_new, self.top_k = z(slots), z(slots), z(slots), \
            z(slots), z(slots)
        self.active, self.stopped = z(slots, dtype=torch.bool), z(slots, dtype=torch.bool)
        self.temperature = z(slots, dtype=torch.float32)
        self.top_p = torch.ones(slots, dtype=torch.float32, device=device)
        self.seed = torch.full((slots,), -1, dtype=torch.long, device=device)
        self.stops = torch.full((slots, MAX_STOPS), -1, dtype=torch.long, device=device)
        self.out_tok = z(slots, max_len + 1)
        self.out_lp = z(slots, max_len + 1, dtype=torch.float32)

    def snapshot(self):
        return [t.clone() for t in (self.tok, self.pos, self.gen, self.active, self.stopped)]

    def restore(self, saved) -> None:
        for t, s in zip((self.tok, self.pos, self.gen, self.active, self.stopped), saved):
            t.copy_(s)


def capture(step: Callable, key: tuple, state: State, device, pool):
    """(A CUDA graph of ``step(*key)``, the graph memory pool), the graph None (eager, logged)
    when capture fails. The warm-up run advances the state: it is restored before capture
    (capture runs nothing)."""
    saved = state.snapshot()
    try:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step(*key)
        torch.cuda.current_stream().wait_stream(stream)
        state.restore(saved)
        if pool is None:
            pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        clock = time.perf_counter()
        with torch.cuda.graph(graph, pool=pool):
            step(*key)
        log.info("decode: captured rows=%d len=%d truncate=%s seeded=%s shared=%d in %.2f s",
                 *key, time.perf_counter() - clock)
        return graph, pool
    except Exception:  # noqa: BLE001 - a step that cannot be captured still runs eagerly
        log.exception("decode: CUDA graph capture of rows=%d len=%d truncate=%s seeded=%s "
                      "shared=%d failed; this shape runs eagerly", *key)
        torch.cuda.synchronize(device)
        state.restore(saved)
        return None, pool


def share_groups(table: list, live: list[int]) -> list[tuple[int, list[int]]]:
    """(shared length, slots) of the live slots that hold one prompt's KV copy."""
    groups: dict = {}
    for s in live:
        if table[s].share is not None:
            key, length = table[s].share
            groups.setdefault(key, (length, []))[1].append(s)
    return list(groups.values())


def prompt_key(request: Request, row: int) -> bytes:
    """The ids of a row's prompt: rows with equal keys, of one request or several, share one
    prefill and one KV copy."""
    return request.keys[request.rows[row][0]]


def distinct_prompts(items: list[tuple[Request, int, int]]
                     ) -> tuple[list[list[int]], list[int]]:
    """The distinct prompts (by their ids) of (request, row, slot) ``items`` in order of first
    use, and for each item the index of its prompt among them."""
    keys: dict[bytes, int] = {}
    prompts, src = [], []
    for request, row, _ in items:
        key = prompt_key(request, row)
        if key not in keys:
            keys[key] = len(prompts)
            prompts.append(request.prompts[request.rows[row][0]])
        src.append(keys[key])
    return prompts, src


def right_padded(rows: list[list[int]]) -> torch.Tensor:
    """ids[len(rows), longest] on the host, each row right-padded with 0."""
    ids = torch.zeros((len(rows), max(len(r) for r in rows)), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row)
    return ids


def bucket(n: int, cap: int) -> int:
    """n rounded up to 8, 12, 16, 24, 32, 48, 64, 96, ... (powers of two and 1.5x), at most
    cap."""
    size = 8
    while size < n:
        size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3
    return min(size, cap)
