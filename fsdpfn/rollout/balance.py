"""Requests spread over several rollout servers by load: the one rule both the recipes'
synchronous stage (and their greedy eval) and RolloutStream follow.

    balancer = Balancer(["http://127.0.0.1:8001", "http://127.0.0.1:8002"])
    answer = generate_balanced(balancer, prompts, n=8, max_new_tokens=256, seed=7)
    answer["outputs"]        # prompt-major, in prompt order, whatever server made them
    answer["servers"]        # the URL that answered each prompt

The rule. A group (the ``n`` samples of one prompt) is the unit: it is never split, so it goes
to exactly one server. A server's load is its outstanding work, the tokens it was asked for and
has not answered yet (``n x (prompt tokens + max_new_tokens)`` per group, or ``n`` rows when the
items are not token ids). A batch of groups is cut into contiguous runs, one per server at most:
the least loaded servers are filled first, each up to a common level (water filling), so after
the cut every server that received work holds about the same load. Contiguous runs keep each
request's groups in data order (a request's seed and the stream's group indices follow from its
first group) and send each server one request per batch, which its decode loop batches.

One server: the whole batch in one request with the caller's seed, exactly as ``generate``.
"""

from __future__ import annotations

import re
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from fsdpfn.errors import ConfigError, WeightSyncError
from fsdpfn.wire.http import check_urls
from fsdpfn.rollout.client import check_prompts, check_request, generate
from fsdpfn.rollout.sampling import prompt_seed

__all__ = ["Balancer", "split_by_load", "generate_balanced", "group_work", "run_seed"]


_PROMPT_INDEX = re.compile(r"\b(input_ids|prompts)\[(\d+)\]")


def renumbered(exc: BaseException, start: int) -> BaseException:
    """``exc`` (a request's error) with each prompt index it names moved on by ``start``: a
    server numbers the prompts of its own request, the caller those of its whole list."""
    message = _PROMPT_INDEX.sub(lambda m: f"{m.group(1)}[{int(m.group(2)) + start}]", str(exc))
    return type(exc)(message)


def split_by_load(loads: Sequence[float], works: Sequence[float],
                  given: Sequence[float] | None = None) -> list[tuple[int, int, int]]:
    """Groups 0..len(works)-1 (in order, ``works[i]`` each) cut into contiguous runs
    ``(server, start, stop)`` over servers whose outstanding work is ``loads``: the least loaded
    server takes the first run, filled up to the level L at which every server's load plus its
    run would be equal (sum over servers below L of (L - load) = the work left), at least one
    group when it is below L, and a further group while that brings it closer to L; then the
    next least loaded server, with L computed again over the servers left. Runs are returned in
    group order; servers above the level get none. Among equally loaded servers the one
    ``given`` the least work so far goes first (then the lowest index), so a batch too small
    for every server does not always land on the first."""
    if not loads:
        raise ConfigError("loads: must name at least one server, got []")
    n = len(works)
    order = sorted(range(len(loads)), key=lambda s: (loads[s], given[s] if given else 0.0, s))
    runs, start = [], 0
    for k, s in enumerate(order):
        if start == n:
            break
        level = _level(sorted(loads[t] for t in order[k:]), float(sum(works[start:])))
        stop, filled = start, float(loads[s])
        if k == len(order) - 1:
            stop = n  # the last server takes what is left
        elif filled < level:
            filled, stop = filled + works[start], start + 1
            while stop < n and filled + works[stop] / 2 <= level:
                filled += works[stop]
                stop += 1
        if stop > start:
            runs.append((s, start, stop))
            start = stop
    return runs


def _level(sorted_loads: list[float], total: float) -> float:
    """The water level L: sum over loads below L of (L - load) == total."""
    for i in range(len(sorted_loads)):
        level = (total + sum(sorted_loads[:i + 1])) / (i + 1)
        if i + 1 == len(sorted_loads) or level <= sorted_loads[i + 1]:
            return level
    return sorted_loads[0]


def group_work(item, n: int, max_new_tokens: int | None) -> float:
    """The work of one group: ``n x (prompt tokens + max_new_tokens)`` for token ids, else
    ``n`` rows (a workflow's data row)."""
    if max_new_tokens is not None and isinstance(item, (list, tuple)):
        return float(n * (len(item) + int(max_new_tokens)))
    return float(n)


def run_seed(seed: int | None, start: int) -> int | None:
    """The seed of the request whose first group is ``start`` of a batch seeded ``seed``: the
    seed itself for the first run (one server: the caller's request), else the seed its first
    prompt has in the whole batch (fsdpfn.rollout.sampling.prompt_seed), so each prompt draws
    what it draws with one server, however the batch is split."""
    if seed is None or start == 0:
        return seed
    return prompt_seed(seed, start)


class Balancer:
    """The outstanding work of each server at ``urls``, shared by every caller that sends to
    them (thread-safe): ``plan(works)`` cuts a batch of groups by load (split_by_load) and
    counts each run's work as outstanding until ``done(url, work)``."""

    def __init__(self, urls: str | Sequence[str]):
        self.urls = check_urls(urls)  # the rule RolloutTarget follows: the same servers
        self._load = {u: 0.0 for u in self.urls}
        self._given = {u: 0.0 for u in self.urls}  # all work ever planned: breaks ties
        self._lock = threading.Lock()

    def plan(self, works: Sequence[float]) -> list[tuple[str, int, int, float]]:
        """``(url, start, stop, work)`` per run, the work now outstanding on that server."""
        with self._lock:
            runs = split_by_load([self._load[u] for u in self.urls], works,
                                 [self._given[u] for u in self.urls])
            out = []
            for s, start, stop in runs:
                work = float(sum(works[start:stop]))
                self._load[self.urls[s]] += work
                self._given[self.urls[s]] += work
                out.append((self.urls[s], start, stop, work))
            return out

    def done(self, url: str, work: float) -> None:
        with self._lock:
            self._load[url] = max(0.0, self._load[url] - work)

    def loads(self) -> dict[str, float]:
        """Each server's outstanding work now."""
        with self._lock:
            return dict(self._load)


def generate_balanced(servers: Balancer | str | Sequence[str], prompts: Sequence[Sequence[int]],
                      *, n: int = 1, max_new_tokens: int = 128, seed: int | None = None,
                      timeout: float = 300.0, **sampling) -> dict:
    """``generate`` over several servers (module doc): each prompt's ``n`` samples from one
    server, the servers' requests concurrent. Returns {weight_version (the smallest any server
    answered with, None when one named none), outputs (prompt-major, prompt order, as
    ``generate``'s), servers (the URL of each prompt)}. A failed request raises its
    WeightSyncError once every request has ended (bad arguments: ConfigError)."""
    balancer = servers if isinstance(servers, Balancer) else Balancer(servers)
    prompts = check_prompts(prompts)  # errors name the caller's index, before any split
    # group_work sizes the groups with n and max_new_tokens; a bad value is refused before any
    # split, with the caller's key
    check_request(n=n, max_new_tokens=max_new_tokens, seed=seed, timeout=timeout, **sampling)
    works = [group_work(p, n, max_new_tokens) for p in prompts]
    runs = balancer.plan(works)

    def request(url, start, stop, work):
        try:
            return generate(url, prompts[start:stop], n=n, max_new_tokens=max_new_tokens,
                            seed=run_seed(seed, start), timeout=timeout, **sampling)
        except (ConfigError, WeightSyncError) as exc:
            if start == 0:
                raise
            raise renumbered(exc, start) from None
        finally:
            balancer.done(url, work)

    if len(runs) == 1:
        answers = [request(*runs[0])]
    else:
        with ThreadPoolExecutor(max_workers=len(runs), thread_name_prefix="fsdpfn-balance") \
                as pool:
            futures = [pool.submit(request, *run) for run in runs]
            errors = [f.exception() for f in futures]
            for error in errors:
                if error is not None:
                    raise error
            answers = [f.result() for f in futures]
    outputs, where, versions = [], [], []
    for (url, start, stop, _), answer in zip(runs, answers):
        for o in answer["outputs"]:
            if "prompt_index" in o:
                o = {**o, "prompt_index": o["prompt_index"] + start}
            outputs.append(o)
        where += [url] * (stop - start)
        versions.append(answer.get("weight_version"))
    if len(runs) == 1:  # one request: the server's answer as it is
        return {**answers[0], "servers": where}
    known = [v for v in versions if v is not None]
    return {"weight_version": min(known) if len(known) == len(versions) else None,
            "outputs": outputs, "servers": where}
