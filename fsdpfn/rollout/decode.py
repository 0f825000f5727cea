"""The rollout server's own decode loop: a slot KV cache, continuous batching, CUDA graphs.

Why not ``model.generate``: it re-runs HF's Python (masks, cache bookkeeping, logits processors,
stopping criteria) on the host at every step whatever the batch, and the GPU waits (BENCHMARKS.md,
"Decode loop (rollout server)", its "before the loop" row). Why not transformers' continuous
batching: its log-probs are taken after the logits processors (top-p / top-k truncated, not the
``behav_logp`` convention below), it has one sampling config per manager (no per-request
temperature / top-p), and its API moved between the 5.x releases we run on. What is kept from
transformers: the model's own modules (embedding, norms, q/k/v/o projections, MLPs, rotary tables,
lm_head) and parameters, so a weight update that re-points the parameters is what the loop reads.
What is ours: the KV cache and attention (fsdpfn/rollout/slot_model.py), the token draws
(fsdpfn/rollout/device_sampling.py), and the scheduling below (its rows, slots, per-slot device
state and graph capture in fsdpfn/rollout/decode_rows.py).

Layout. ``slots`` rows, each a KV cache of ``max_len`` positions per layer ([S, kv_heads, L, D]). A
request's n samples of one prompt are prefilled once (one forward of the prompt) and the prompt's
KV is copied into their n slots (prefix sharing); so are the rows of equal prompts (the same ids)
of requests admitted together, such as a workflow's episodes of one data row. With the Triton
attention the rows of a group read that KV from the group's first slot, so it leaves HBM about once
per step for the n rows instead of once each (SlotModel.set_shared: the slots holding one prefill's
copy form a group, rebuilt when rows come or go; a row whose KV is recomputed after a weight swap
leaves its group, its copy no longer the same bits). Decode runs one token for slots [0, R) per
step; R and the attended length are rounded up to buckets, so each (R, length, truncation, sharing
on or off) is one shape. The step (forward on [R, 1], sampling, bookkeeping: stop tokens, lengths,
token and log-prob buffers) touches only device tensors, so on CUDA it is captured once per shape
in a CUDA graph and replayed with one host call; the host reads the small per-slot state every
``sync_every`` steps (or sooner, when a row is due to end), returns finished rows and lets queued
rows take free slots (continuous batching: requests of any client share the steps).

Versions. The loop holds the engine's model lock for a chunk of steps and releases it between
chunks, so a weight swap lands between two steps. Each token is tagged with the weights version
that produced it (``weight_versions`` per output). After a swap the KV of the rows in flight is
recomputed with the new weights (one prefill of their prompt and tokens so far), so every token's
log-prob is exactly that of the teacher-forced forward of the version it names, never of a mix.
The parameters also live elsewhere after a swap: the graphs (which captured their addresses) are
dropped and captured again. A trainer that pauses before an update (drains) pays neither.

Log-probs: log_softmax(logits / T) at the sampled token in float32, temperature applied, top-p /
top-k not (T = 1 for greedy rows), as in the engine's HF path. On CUDA, rows without top-p or
top-k draw from the model-dtype logits with two small kernels (fsdpfn/rollout/draw_kernel.py: the
inverse CDF, one uniform per row, the same log-prob), instead of the float32 passes of
device_sampling.sample.

Sampling options: temperature, top-p, top-k, stop token ids and a per-request seed run inside the
step. A seeded row (sample j of prompt i: row_seed(seed, i, j)) draws depending only on that
seed, the token's index and its logits, never on what else is batched: the exponential race from a hash of (seed, step, token id) on the CPU and
for the first token, the inverse CDF at a Philox uniform keyed by (seed, step) in the CUDA loop
(so a seed reproduces on the same kind of device, not across CPU and CUDA). Stop
strings are matched on the finished rows by the engine. Penalties, min_new_tokens and min_p are
refused by name (the engine checks before queueing); HF generate (--decode hf) serves them.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import torch

from fsdpfn.rollout import draw_kernel
from fsdpfn.rollout.decode_rows import (MAX_STOPS, Request, Slot, State, bucket, capture,
                                        distinct_prompts, prompt_key, right_padded,
                                        share_groups)
from fsdpfn.rollout.device_sampling import row_seed, sample
from fsdpfn.rollout.slot_model import SUPPORTED, SlotModel, unsupported_reason

__all__ = ["Decoder", "unsupported_reason", "sample", "row_seed", "SUPPORTED", "MAX_STOPS"]

log = logging.getLogger("fsdpfn.rollout")

LEN_BUCKET = 256  # attended length rounded up to this


class Decoder:
    """Continuous-batching generation over a slot cache (see the module doc). ``generate`` may
    be called from many threads; one scheduler thread runs the model.

    ``lock``: held while the model runs (the engine's model lock); ``version``: returns the
    weights version now served (read with the lock held)."""

    def __init__(self, model, *, lock: threading.Lock, version: Callable[[], int],
                 slots: int, max_len: int, cuda_graphs: bool = True, sync_every: int = 16,
                 prefill_tokens: int = 16384, attention: str = "auto", compile: bool = False,
                 rope_kv: str = "auto", share_prefix: bool = True,
                 kv_cache_dtype: str = "auto"):
        self.net = SlotModel(model, slots, max_len, attention, compile, rope_kv=rope_kv,
                             share_prefix=share_prefix, kv_cache_dtype=kv_cache_dtype)
        self.state = State(slots, max_len, self.net.device)
        # untruncated rows draw with draw_kernel.py (CUDA); the key of the unseeded rows'
        # uniforms, advanced by every step (in the graphs too)
        self.fused_draw = draw_kernel.available(self.net.device)
        self.noise_key = torch.randint(0, 2**31 - 1, (1,), device=self.net.device)
        self.params = [p for _, p in model.named_parameters()]
        self.lock, self.version = lock, version
        self.slots, self.max_len = slots, max_len
        self.sync_every, self.prefill_tokens = sync_every, prefill_tokens
        self.use_graphs = cuda_graphs and self.net.device.type == "cuda"
        self.graphs: dict[tuple, object] = {}
        self.graph_key = None  # the parameters' addresses the graphs were captured with
        self.weights = None  # (version, parameter addresses) the KV cache was computed with
        self.pool = None
        self.table: list[Slot | None] = [None] * slots
        self.pending: list[Request] = []  # requests with rows not yet admitted
        self.inflight: set[Request] = set()  # requests not yet answered
        self.cond = threading.Condition()
        self.thread: threading.Thread | None = None
        self.steps = 0  # decode steps run, and seconds spent in them (for benchmarks)
        self.step_seconds = 0.0
        # the slots that hold one prompt's KV (prefilled once, copied to its samples' slots)
        # read it from the group's first slot (SlotModel.set_shared): rebuilt when rows come or go
        self.prefills = 0
        self.prefill_prompts = 0  # distinct prompts prefilled (for benchmarks, tests)
        self.shared_steps = 0  # decode steps run with shared prompts (for benchmarks, tests)
        self.prefill_seconds = 0.0  # admitting rows: their prompts' prefill and first draw
        self.groups_stale = False
        self.shared = 0  # what SlotModel.set_shared returned: 1 when some group shares, else 0

    # ------------------------------------------------------------ the client side

    def generate(self, prompts: list[list[int]], sp,
                 aborted: set[int] | None = None) -> list[dict]:
        """n outputs per prompt, prompt-major: {prompt_index, output_ids, output_logprobs,
        finish_reason, weight_versions}, the ids (int64) and log-probs (float32) as CPU tensors,
        one row each (RolloutEngine.generate makes them lists, or packs them as they are).
        Blocks until every row is done. ``aborted``: the set of row indices the caller marks
        to stop (RolloutEngine.abort; ``wake`` after marking): a marked row ends at the next
        chunk's start with the tokens it has, finish_reason "abort" (none when still queued)."""
        request = Request(prompts, sp, aborted)
        with self.cond:
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, daemon=True,
                                               name="fsdpfn-decode")
                self.thread.start()
            self.pending.append(request)
            self.inflight.add(request)
            self.cond.notify_all()
        request.done.wait()
        if request.error is not None:
            raise request.error
        return request.results

    def wake(self) -> None:
        """Rows were marked aborted: the scheduler answers them at its next chunk."""
        with self.cond:
            self.cond.notify_all()

    # ------------------------------------------------------------ the scheduler

    def _run(self) -> None:
        if self.net.device.type == "cuda":
            torch.cuda.set_device(self.net.device)
        while True:
            with self.cond:
                while not self.pending and not any(self.table):
                    self.cond.wait()
            try:
                with self.lock, torch.no_grad():
                    finished = self._iteration()
            except BaseException as exc:  # noqa: BLE001 - fail the requests, keep serving
                log.exception("decode loop failed")
                self._fail_all(exc)
                continue
            self._deliver(finished)
            time.sleep(0)  # let a waiting weight swap take the lock between chunks

    def _iteration(self) -> list[tuple[Slot, torch.Tensor, torch.Tensor, str]]:
        """Answer the aborted rows, admit queued rows, run a chunk of steps, read which rows
        ended (model lock held)."""
        version = self.version()
        finished = self._take_aborted(version)
        key = tuple(p.data_ptr() for p in self.params)
        if key != self.graph_key:  # weights re-pointed by an update: old graphs read freed memory
            self.graphs.clear()
            self.pool = None  # a fresh pool: the allocator refuses capture into a dropped one
            self.graph_key = key
        if (version, key) != self.weights:  # rows in flight continue on the new weights only
            self.weights = (version, key)
            self.net.refresh_weights()  # the fused q/k/v buffers read the served weights
            self._refresh([s for s in range(self.slots) if self.table[s] is not None], version)
        clock = time.perf_counter()
        self._admit(version)
        self.prefill_seconds += time.perf_counter() - clock
        live = [s for s in range(self.slots) if self.table[s] is not None]
        if not live:  # every row was aborted
            return finished
        if self.groups_stale:
            self.shared = self.net.set_shared(share_groups(self.table, live))
            self.groups_stale = False
        R = bucket(max(live) + 1, self.slots)
        remaining = min(self.table[s].request.sp.max_new_tokens - self.table[s].gen
                        for s in live)
        steps = max(1, min(self.sync_every, remaining))
        Lb = min(self.max_len, -(-max(self.table[s].bound(steps) for s in live)
                                 // LEN_BUCKET) * LEN_BUCKET)
        # per-step options that cost a pass over [R, V]: in the step (and its graph) only when a
        # live row asks for them
        truncate = any(self.table[s].truncate for s in live)
        seeded = any(self.table[s].seeded for s in live)
        clock = time.perf_counter()
        for _ in range(steps):
            self._replay(R, Lb, truncate, seeded, self.shared)
        finished += self._collect(live)  # reads the device: the steps are done
        self.steps += steps
        self.shared_steps += steps if self.shared else 0
        self.step_seconds += time.perf_counter() - clock
        return finished

    def _take_aborted(self, version: int) -> list[tuple[Slot, torch.Tensor, torch.Tensor, str]]:
        """The rows marked aborted: those in slots end with the tokens they have (their slots
        freed), those still queued with none; each answered "abort"."""
        st, out = self.state, []
        ended = [s for s in range(self.slots) if self.table[s] is not None
                 and self.table[s].row in self.table[s].request.aborted]
        if ended:
            index = torch.tensor(ended, device=st.tok.device)
            gen = st.gen[index].cpu().tolist()
            width = max(gen)
            toks, lps = st.out_tok[index, :width].cpu(), st.out_lp[index, :width].cpu()
            st.active[index] = False
            for i, s in enumerate(ended):
                out.append((self.table[s], toks[i][:gen[i]], lps[i][:gen[i]], "abort"))
                self.table[s] = None
            self.groups_stale = True
        with self.cond:
            for request in self.pending:
                for row in range(request.next_row, len(request.rows)):
                    if row in request.aborted and row not in request.resolved:
                        request.resolved.add(row)
                        prompt = request.prompts[request.rows[row][0]]
                        out.append((Slot(request, row, len(prompt), version),
                                    torch.zeros(0, dtype=torch.long),
                                    torch.zeros(0, dtype=torch.float32), "abort"))
        return out

    def _collect(self, live: list[int]) -> list[tuple[Slot, torch.Tensor, torch.Tensor, str]]:
        st = self.state
        flags = torch.stack([st.active.long(), st.gen, st.stopped.long()])[:, :max(live) + 1]
        active, gen, stopped = flags.cpu().tolist()
        ended = [s for s in live if not active[s]]
        for s in live:
            self.table[s].gen = gen[s]
        if not ended:
            return []
        width = max(gen[s] for s in ended)
        index = torch.tensor(ended, device=st.tok.device)
        toks = st.out_tok[index, :width].cpu()  # one read each; rows stay tensors (views)
        lps = st.out_lp[index, :width].cpu()
        out = []
        for i, s in enumerate(ended):
            out.append((self.table[s], toks[i][:gen[s]], lps[i][:gen[s]],
                        "stop" if stopped[s] else "length"))
            self.table[s] = None
        self.groups_stale = True
        return out

    def _deliver(self, finished) -> None:
        for slot, toks, lps, reason in finished:
            request = slot.request
            versions = []
            bounds = [b for b, _ in slot.segments[1:]] + [len(toks)]
            for (start, v), end in zip(slot.segments, bounds):
                versions += [v] * (min(end, len(toks)) - start)
            prompt_index = request.rows[slot.row][0]
            request.results[slot.row] = {
                "prompt_index": prompt_index, "output_ids": toks, "output_logprobs": lps,
                "finish_reason": reason, "weight_versions": versions}
            request.remaining -= 1
            if request.remaining == 0:
                with self.cond:
                    self.inflight.discard(request)
                request.done.set()

    def _fail_all(self, exc: BaseException) -> None:
        with self.cond:
            requests, self.inflight = self.inflight, set()
            self.pending.clear()
        self.table = [None] * self.slots
        self.state.active.zero_()
        for r in requests:
            r.error = exc
            r.done.set()

    def _refresh(self, live: list[int], version: int) -> None:
        """The weights changed between two steps: recompute the KV of the rows in flight (prompt
        and tokens so far) with the new weights, so each later token is exactly what the new
        weights give for the whole row; the tokens after this point name the new version."""
        if not live:
            return
        st, device = self.state, self.net.device
        width = max(self.table[s].gen for s in live)
        toks = st.out_tok[torch.tensor(live, device=device), :width].cpu().tolist()
        rows = []
        self.groups_stale = True  # each row's prompt is recomputed on its own: no longer shared
        for s, out in zip(live, toks):
            slot = self.table[s]
            slot.share = None
            prompt = slot.request.prompts[slot.request.rows[slot.row][0]]
            rows.append((s, prompt + out[:slot.gen - 1]))  # the last token is the next input
            slot.segments.append((slot.gen, version))
        rows.sort(key=lambda r: len(r[1]))
        start = 0
        while start < len(rows):
            end = start + 1
            while end < len(rows) and (end + 1 - start) * len(rows[end][1]) <= \
                    self.prefill_tokens:
                end += 1
            chunk = rows[start:end]
            ids = right_padded([row for _, row in chunk])
            self.net.prefill(ids.to(device), torch.tensor([len(r) for _, r in chunk],
                                                          device=device),
                             torch.tensor([s for s, _ in chunk], device=device),
                             torch.arange(len(chunk), device=device))
            start = end

    # ------------------------------------------------------------ admission (prefill)

    def _admit(self, version: int) -> None:
        """Queued rows take free slots (lowest first); each prompt is prefilled once for all of
        its rows admitted now, whichever requests they belong to (equal ids, one prefill)."""
        free = [s for s in range(self.slots) if self.table[s] is None]
        taken: list[tuple[Request, int, int]] = []  # (request, row, slot)
        with self.cond:
            while free and self.pending:
                request = self.pending[0]
                while free and request.next_row < len(request.rows):
                    if request.next_row not in request.resolved:  # else answered "abort"
                        taken.append((request, request.next_row, free.pop(0)))
                    request.next_row += 1
                if request.next_row == len(request.rows):
                    self.pending.pop(0)
        groups: dict = {}  # the rows of each prompt (by its ids), in order
        for request, row, s in taken:
            groups.setdefault(prompt_key(request, row), []).append((request, row, s))
        chunk, width, n_prompts = [], 0, 0
        for items in groups.values():  # prefill chunks of at most prefill_tokens padded tokens
            request, row, _ = items[0]
            length = len(request.prompts[request.rows[row][0]])
            if chunk and (n_prompts + 1) * max(width, length) > self.prefill_tokens:
                self._prefill(chunk, version)
                chunk, width, n_prompts = [], 0, 0
            chunk += items
            width, n_prompts = max(width, length), n_prompts + 1
        if chunk:
            self._prefill(chunk, version)

    def _prefill(self, items: list[tuple[Request, int, int]], version: int) -> None:
        device, st = self.net.device, self.state
        prompts, src = distinct_prompts(items)
        ids = right_padded(prompts)
        lengths = torch.tensor([len(p) for p in prompts], device=device)
        src = torch.tensor(src, device=device)
        slots = torch.tensor([s for _, _, s in items], device=device)
        logits = self.net.prefill(ids.to(device), lengths, slots, src)[src]  # (N, V)
        sps = [r.sp for r, _, _ in items]
        temperature = torch.tensor([float(sp.temperature) for sp in sps], device=device)
        top_p = torch.tensor([float(sp.top_p) for sp in sps], device=device)
        top_k = torch.tensor([sp.top_k for sp in sps], device=device)
        seeds = torch.tensor([row_seed(r.sp.seed, *r.rows[w]) for r, w, _ in items],
                             device=device)
        seeded = any(sp.seed is not None for sp in sps)
        token, logp = sample(logits, temperature, top_p, top_k,
                             truncate=any(sp.top_p < 1 or sp.top_k > 0 for sp in sps),
                             seeds=seeds if seeded else None, steps=torch.zeros_like(seeds))
        stops = torch.full((len(items), MAX_STOPS), -1, dtype=torch.long)
        for i, sp in enumerate(sps):
            stops[i, :len(sp.stop_token_ids)] = torch.tensor(sp.stop_token_ids, dtype=torch.long)
        stops = stops.to(device)
        max_new = torch.tensor([sp.max_new_tokens for sp in sps], device=device)
        stopped = (token[:, None] == stops).any(-1)
        st.tok[slots], st.pos[slots], st.gen[slots] = token, lengths[src], 1
        st.out_tok[slots, 0], st.out_lp[slots, 0] = token, logp
        st.temperature[slots], st.top_p[slots], st.top_k[slots] = temperature, top_p, top_k
        st.seed[slots] = seeds
        st.stops[slots], st.max_new[slots], st.stopped[slots] = stops, max_new, stopped
        st.active[slots] = ~stopped & (max_new > 1)
        self.prefills += 1
        self.prefill_prompts += len(prompts)
        for (request, row, s), n, i in zip(items, lengths[src].tolist(), src.tolist()):
            self.table[s] = Slot(request, row, n, version)
            self.table[s].share = ((self.prefills, i), n)  # one KV copy per distinct prompt
        self.groups_stale = True

    # ------------------------------------------------------------ the step, eager or graphed

    def _step(self, R: int, Lb: int, truncate: bool, seeded: bool, shared: int = 0) -> None:
        """One token for slots [0, R): forward, sampling, bookkeeping (device only)."""
        st = self.state
        tok, pos, gen, active = st.tok[:R], st.pos[:R], st.gen[:R], st.active[:R]
        if self.fused_draw and not truncate:
            logits = self.net.decode(tok, pos, Lb, raw=True, shared=shared)
            token, logp = draw_kernel.draw(logits, st.temperature[:R], self.noise_key,
                                           seeds=st.seed[:R] if seeded else None, steps=gen)
            self.noise_key.add_(1)
        else:
            logits = self.net.decode(tok, pos, Lb, shared=shared)
            token, logp = sample(logits, st.temperature[:R], st.top_p[:R], st.top_k[:R],
                                 truncate=truncate, seeds=st.seed[:R] if seeded else None,
                                 steps=gen)
        where = (self.net.rows[:R], gen)  # finished rows write past their end: never read
        st.out_tok.index_put_(where, token)
        st.out_lp.index_put_(where, logp)
        stop = active & (token[:, None] == st.stops[:R]).any(-1)
        gen_next = gen + active.long()
        st.stopped[:R] |= stop
        st.active[:R] = active & ~stop & (gen_next < st.max_new[:R])
        st.tok[:R] = torch.where(active, token, tok)
        st.pos[:R] = pos + active.long()
        st.gen[:R] = gen_next

    def _replay(self, R: int, Lb: int, truncate: bool, seeded: bool, shared: int) -> None:
        key = (R, Lb, truncate, seeded, shared)
        if self.use_graphs and key not in self.graphs:
            self.graphs[key], self.pool = capture(self._step, key, self.state, self.net.device,
                                                   self.pool)
        graph = self.graphs.get(key) if self.use_graphs else None
        if graph is None:
            self._step(*key)
        else:
            graph.replay()
