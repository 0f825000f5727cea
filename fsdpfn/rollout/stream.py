"""RolloutStream: generation that runs ahead of training, within a staleness bound.

For asynchronous RL in a custom loop (rank 0 of the trainer holds the stream):

    stream = RolloutStream(urls, prompt_at, group_size=8, groups_per_step=64, max_staleness=2,
                           sampling={"max_new_tokens": 512}, version=actor.version,
                           steps=steps)
    for step in range(steps):
        batch = stream.next_batch()            # the step's groups, in data order; waits for them
        ...                                    # log-probs, advantages, ppo_step: actor.version + 1
        receipt = push_weights(actor, target)  # the servers serve the new weights
        stream.advance(receipt.version)        # generation may run one more step ahead
    stream.close()

Admission control (AReaL's rule). The groups are numbered in data order from ``start``; group m
belongs to step s(m) = (m - start) // groups_per_step. It is sent to a server only once s(m) <=
advances + max_staleness, where advances counts ``advance`` calls (one push per step). Groups are
handed to the trainer in data order, so the trainer of step s holds the weights of advance s; a
group admitted after advance a (a >= s - max_staleness) carries tokens of version >= that
advance's, so its staleness is at most ``max_staleness``. Staleness counts pushes: how many
``advance`` calls before the trained weights the oldest of a sample's tokens was served (the
version trained minus the oldest token's version when every push moves the version on by one,
as ``ppo_step`` does; a loop that changes the weights twice between pushes still has its bound
kept and reported in pushes). Nothing is thrown away: generation that would exceed the bound
waits, and with ``steps`` nothing past the last step is generated.
With ``max_staleness=0`` a step's groups are sent only after the previous step's push: the
synchronous loop. In order of data also means a resumed run's data cursor is a prefix: the groups
handed out, no more (groups in flight at a stop are generated again).

Servers. ``urls`` may name several servers: the groups admitted together are cut by load
(fsdpfn.rollout.balance, the rule the recipes' synchronous stage follows too): contiguous runs,
one request per server at most, the least loaded servers (outstanding requested tokens) filled
first; the samples of one prompt (a group) always share one request, so one server. A server's
in-flight requests continue across a weight update when the trainer does not pause generation
(``PushConfig(pause_generation=False)``): the server's decode loop swaps the weights between two
decode steps and tags every token with the version that produced it.
"""

from __future__ import annotations

import bisect
import operator
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import attrs

from fsdpfn.errors import ConfigError, WeightSyncError
from fsdpfn.rollout.errors import SEED_END
from fsdpfn.rollout.balance import Balancer, group_work, renumbered
from fsdpfn.rollout.client import MAX_NEW_TOKENS, check_prompts, check_request, generate
from fsdpfn.rollout.sampling import SamplingParams, prompt_seed

__all__ = ["RolloutStream", "Group", "StreamBatch", "token_versions"]

# every sampling parameter of the server but n and seed (the stream sets those), and the timeout
SAMPLING_KEYS = (*(k for k in SamplingParams.FIELDS if k not in ("n", "seed")), "timeout")
# groups admitted per round (one plan over the servers): a step of more groups is sent in rounds,
# so close() and the first requests never wait for a whole step's prompt_at calls
ADMIT_GROUPS = 1024


@attrs.frozen
class Group:
    """The ``n`` samples of one prompt. ``index``: the prompt's position in the data order;
    ``outputs``: the server's answers ({output_ids, output_logprobs, weight_versions, ...});
    ``admitted_after``: how many advances the stream had seen when it sent the group;
    ``score``: what the stream's ``score`` callable returned for it (None without one);
    ``sent`` / ``answered``: the host clock (time.perf_counter) when its request was sent and
    answered."""

    index: int
    prompt_ids: list
    outputs: list
    server: str
    admitted_after: int
    score: Any = None
    sent: float | None = None
    answered: float | None = None

    @property
    def oldest_version(self) -> int | None:
        """The oldest weights version among the group's tokens (None: no token generated)."""
        versions = [min(v) for v in map(token_versions, self.outputs) if v]
        return min(versions) if versions else None


def token_versions(output) -> list:
    """The weights version of every sampled token of one sample: a server output's
    ``weight_versions``, or every turn's versions of an episode (anything with ``turns``)."""
    if isinstance(output, dict):
        return list(output.get("weight_versions") or [])
    return [v for turn in getattr(output, "turns", ()) for v in turn.versions]


@attrs.frozen
class StreamBatch:
    """One step's groups (data order), the version they are trained at, and the step's stream
    statistics: staleness_mean / staleness_max (over samples, in pushes: module doc),
    off_policy_token_frac (tokens of an older version than the one trained),
    trainer_wait_seconds (next_batch blocked),
    rollout_wait_seconds (generation held back by the bound since the last batch),
    generation_span_seconds (from the first of the step's requests sent to the last answered)."""

    groups: list
    version: int
    stats: dict


def _int(name: str, value, low: int) -> int:
    """``value`` as an int >= ``low`` (an int, or a numpy / 0-d torch integer; never a bool, a
    float or a string of digits), else ConfigError naming it."""
    try:
        out = None if isinstance(value, bool) else operator.index(value)
    except TypeError:
        out = None
    if out is None or out < low:
        raise ConfigError(f"{name}: must be an integer >= {low}, got {value!r}")
    return out


def _check_args(group_size, groups_per_step, max_staleness, start, sampling) -> tuple:
    """The four counts as plain ints (they size the stream's pools); the sampling parameters
    checked by the server's own rules, values included, before any request is built."""
    counts = tuple(_int(name, value, low) for name, value, low in (
        ("group_size", group_size, 1), ("groups_per_step", groups_per_step, 1),
        ("max_staleness", max_staleness, 0), ("start", start, 0)))
    unknown = sorted(set(sampling) - set(SAMPLING_KEYS))
    if unknown:
        raise ConfigError(f"sampling: unknown key {unknown[0]!r}; allowed: {list(SAMPLING_KEYS)}")
    try:  # what each request will send: the group's samples, generate's defaults
        check_request(**{"max_new_tokens": MAX_NEW_TOKENS, **sampling, "n": counts[0]})
    except ConfigError as exc:
        raise ConfigError(f"sampling.{exc}") from None
    return counts


class RolloutStream:
    """Keeps up to (max_staleness + 1) steps of groups in flight against rollout servers (module
    doc). ``prompt_at(i)``: the token ids of the i-th prompt of the data order (None or
    IndexError: the data ended). ``score(groups) -> list``: called once per finished request on
    the stream's own thread (one call at a time), its results stored on the groups.
    ``runner(url, first, items) -> [outputs of each item]``: what a request is (default: one
    ``generate`` of the items' token ids, ``group_size`` samples each; a workflow runner makes
    episodes instead: then ``prompt_at`` may return any item, e.g. the data row). ``steps``: how
    many batches the trainer will take; nothing past the last is generated (a workflow with side
    effects is never started on a row no step trains), and a further ``next_batch`` raises
    StopIteration. None: the stream runs on until the data ends or ``close()``."""

    def __init__(self, urls: str | Sequence[str], prompt_at: Callable[[int], Any],
                 *, group_size: int, groups_per_step: int, max_staleness: int = 0,
                 start: int = 0, version: int = 0, sampling: dict | None = None,
                 score: Callable[[list], list] | None = None, seed: int | None = None,
                 runner: Callable[[str, int, list], list] | None = None,
                 steps: int | None = None):
        if sampling is not None and not isinstance(sampling, Mapping):
            raise ConfigError(f"sampling: must be a mapping of sampling parameters (or None), got "
                              f"{type(sampling).__name__}")
        sampling = dict(sampling or {})
        group_size, groups_per_step, max_staleness, start = _check_args(
            group_size, groups_per_step, max_staleness, start, sampling)
        version = _int("version", version, 0)
        seed = None if seed is None else _int("seed", seed, 0)
        if seed is not None and seed >= SEED_END:  # the servers' sampling seeds' range
            raise ConfigError(f"seed: must be an int in [0, 2**63), got {seed!r}")
        steps = None if steps is None else _int("steps", steps, 0)
        if runner is not None and not callable(runner):
            raise ConfigError(f"runner: must be callable (url, first, items) -> outputs, got "
                              f"{runner!r}")
        if not isinstance(urls, (str, list, tuple)) or (not isinstance(urls, str) and not urls):
            raise ConfigError(f"urls: must name at least one rollout server ('http://host:port' "
                              f"or a list of them), got {urls!r}")
        if not callable(prompt_at):
            raise ConfigError(f"prompt_at: must be callable (index -> a prompt), got "
                              f"{type(prompt_at).__name__}")
        if score is not None and not callable(score):
            raise ConfigError(f"score: must be callable (groups -> one result each) or None, got "
                              f"{type(score).__name__}")
        self.urls = [urls] if isinstance(urls, str) else list(urls)
        self.balancer = Balancer(self.urls)  # outstanding work per server (balance.py)
        self.prompt_at, self.score, self.sampling, self.seed = prompt_at, score, sampling, seed
        self.runner, self.token_items = runner or self._generate, runner is None
        self.G, self.B, self.N = group_size, groups_per_step, max_staleness
        self.steps = steps  # batches the trainer will take (None: until the data ends)
        self.start = self.next_index = self.consumed = start
        self.version = version
        self.pushed = [version]  # the version served after each advance (index 0: at the start)
        self.cond = threading.Condition()
        self.finished: dict[int, Group] = {}
        self.error: BaseException | None = None
        self.ended_at: int | None = None  # first index with no prompt
        self.closed = False
        self.held_since: float | None = None  # when the bound began holding generation back
        self.held_seconds = 0.0
        self.score_lock = threading.Lock()
        self.pool = ThreadPoolExecutor(max_workers=(max_staleness + 1) * len(self.urls) + 1,
                                       thread_name_prefix="fsdpfn-stream")
        self.scheduler = threading.Thread(target=self._schedule, daemon=True,
                                          name="fsdpfn-stream-admit")
        self.scheduler.start()

    # ------------------------------------------------------------ the trainer's side

    def next_batch(self, timeout: float | None = None) -> StreamBatch:
        """The next step's ``groups_per_step`` groups in data order, once all are generated
        (and scored). Raises what a request raised (WeightSyncError), StopIteration when the
        data ended before a whole step, TimeoutError after ``timeout`` seconds."""
        t0 = time.perf_counter()
        want = range(self.consumed, self.consumed + self.B)
        with self.cond:
            if self.closed:
                raise ConfigError("next_batch: the stream is closed (close() was called); "
                                  "start a new RolloutStream at start=stream.cursor")
            if self.steps is not None and want.start >= self.start + self.steps * self.B:
                raise StopIteration(f"the stream's steps={self.steps} batches were handed out")
            while not all(i in self.finished for i in want):
                if self.error is not None:
                    raise self.error
                if self.ended_at is not None and self.ended_at < want.stop:
                    raise StopIteration(f"the data ended at prompt {self.ended_at}")
                left = None if timeout is None else timeout - (time.perf_counter() - t0)
                if left is not None and left <= 0:
                    step = (want.start - self.start) // self.B
                    bound = ("" if step <= self.advances + self.N else
                             f"; they wait for advance(): step {step} is past "
                             f"{self.advances} advance(s) + max_staleness={self.N} (call "
                             f"stream.advance(version) after each step's push)")
                    raise TimeoutError(f"next_batch: groups {want.start}..{want.stop - 1} not "
                                       f"generated within {timeout} s{bound}")
                self.cond.wait(left)
            groups = [self.finished.pop(i) for i in want]
            self.consumed = want.stop
            held = self._take_held_seconds()
            pushed = list(self.pushed)
        return StreamBatch(groups, self.version,
                           _stats(groups, pushed, time.perf_counter() - t0, held))

    def advance(self, version: int) -> None:
        """The servers now serve ``version`` (call it after each step's push): generation may
        run one step further ahead. Once per batch handed out (a step whose weights did not
        change advances with the same version); more is a ConfigError."""
        version = _int("version", version, 0)
        with self.cond:
            if version < self.version:
                raise ConfigError(f"version: must not go backwards, got {version} after "
                                  f"{self.version}")
            handed = (self.consumed - self.start) // self.B
            if self.advances >= handed:  # each advance lets admission run one step further
                raise ConfigError(
                    f"advance: must be called once after each step's push, at most once per "
                    f"batch next_batch handed out: {handed} handed out, {self.advances} "
                    f"advance(s) already, got another (version {version}); an extra advance "
                    f"would let generation run past max_staleness={self.N}. Weights pushed "
                    f"before the first step belong in RolloutStream(version=...)")
            self.version = version
            self.pushed.append(version)
            self.cond.notify_all()

    @property
    def advances(self) -> int:
        """How many ``advance`` calls the stream has seen."""
        return len(self.pushed) - 1

    @property
    def cursor(self) -> int:
        """How many prompts of the data order were handed to the trainer (a resume starts here)."""
        return self.consumed

    def close(self) -> None:
        """Stop admitting; requests in flight are abandoned (their answers are dropped: the
        servers may still finish them) and next_batch raises from now on."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        self.pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> "RolloutStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ admission

    def _admissible(self) -> int:
        """How many groups may be sent now: up to the end of step advances + N, and of the
        last of ``steps`` (lock held)."""
        ahead = self.advances + self.N + 1
        limit = self.start + (ahead if self.steps is None else min(ahead, self.steps)) * self.B
        return max(0, limit - self.next_index)

    def _take_held_seconds(self) -> float:
        now = time.perf_counter()
        held = self.held_seconds + (now - self.held_since if self.held_since is not None else 0)
        self.held_seconds = 0.0
        self.held_since = now if self.held_since is not None else None
        return held

    def _schedule(self) -> None:
        try:
            self._admit()
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer by next_batch
            with self.cond:
                self.error = self.error or WeightSyncError(
                    f"rollout stream: admission failed: {type(exc).__name__}: {exc}")
                self.cond.notify_all()

    def _admit(self) -> None:
        """Admit groups as the bound allows, in rounds of at most ADMIT_GROUPS. The user's
        ``prompt_at`` runs outside the lock: a slow dataset never holds back next_batch,
        advance, close or the answers' bookkeeping, and the first requests of a large step go
        out before its last prompts are read."""
        while True:
            with self.cond:
                while not self.closed and self.error is None and self.ended_at is None \
                        and self._admissible() == 0:
                    if self.held_since is None:
                        self.held_since = time.perf_counter()
                    self.cond.wait()
                if self.held_since is not None:
                    self.held_seconds += time.perf_counter() - self.held_since
                    self.held_since = None
                if self.closed or self.error is not None or self.ended_at is not None:
                    return
                first = self.next_index
                count = min(self._admissible(), self.B - (first - self.start) % self.B,
                            ADMIT_GROUPS)
                admitted = self.advances
            prompts, ended, error = self._prompts(first, count)  # this thread alone admits
            with self.cond:
                if self.closed:
                    return
                if error is not None:
                    self._fail(error)
                if ended is not None:
                    self.ended_at = ended
                    self.cond.notify_all()  # a trainer waiting past the end hears it now
                self.next_index = first + len(prompts)
            for url, start, stop, work in self._plan(prompts):
                self.pool.submit(self._request, url, first + start, prompts[start:stop],
                                 admitted, work)

    def _prompts(self, first: int, count: int) -> tuple[list, int | None, BaseException | None]:
        """Up to ``count`` prompts from ``first`` (the lock not held: ``prompt_at`` is the
        user's code), the first index with no prompt if the data ended there, and the
        ConfigError of a prompt_at that failed or returned no prompt."""
        out = []
        for i in range(first, first + count):
            try:
                ids = self.prompt_at(i)
            except IndexError:
                ids = None
            except Exception as exc:  # noqa: BLE001 - handed to the trainer by next_batch
                return out, None, ConfigError(
                    f"prompt_at: must return prompt {i} (or raise IndexError past the end), "
                    f"raised {type(exc).__name__}: {exc}")
            if ids is None:
                return out, i, None
            if self.token_items:  # the default runner sends token ids: checked here, by index
                try:
                    ids = check_prompts([ids])[0]
                except ConfigError:
                    return out, None, ConfigError(
                        f"prompt_at: must return prompt {i} as a non-empty list of token ids "
                        f"(ints >= 0; a workflow runner takes other items), got "
                        f"{str(ids)[:80]!r}")
            out.append(ids)
        return out, None, None

    def _fail(self, error: BaseException) -> None:
        """Hand ``error`` to the trainer's next next_batch (lock held)."""
        self.error = self.error or error
        self.cond.notify_all()

    def _plan(self, prompts: list) -> list:
        """The admitted groups cut by load over the servers: (url, start, stop, work) runs."""
        if not prompts:
            return []
        limit = self.sampling.get("max_new_tokens", MAX_NEW_TOKENS) if self.token_items else None
        return self.balancer.plan([group_work(p, self.G, limit) for p in prompts])

    # ------------------------------------------------------------ requests

    def _generate(self, url: str, first: int, prompts: list) -> list:
        """The default runner: one generate of ``prompts``, their samples split per prompt."""
        # group g draws with prompt_seed(seed, g) whichever request carries it
        seed = None if self.seed is None else prompt_seed(self.seed, first)
        try:
            answer = generate(url, prompts, n=self.G, seed=seed, **self.sampling)
        except (ConfigError, WeightSyncError) as exc:  # its indices: those of the data order
            raise renumbered(exc, first) from None
        return [answer["outputs"][i * self.G:(i + 1) * self.G] for i in range(len(prompts))]

    def _request(self, url: str, first: int, prompts: list, admitted: int,
                 work: float) -> None:
        try:
            sent = time.perf_counter()
            outputs = list(self.runner(url, first, prompts))
            answered = time.perf_counter()
            if len(outputs) != len(prompts):
                raise ConfigError(f"runner: must return one output list per item, got "
                                  f"{len(outputs)} for {len(prompts)} items (prompts "
                                  f"{first}..{first + len(prompts) - 1})")
            groups = [Group(first + i, prompts[i], outputs[i], url, admitted, sent=sent,
                            answered=answered) for i in range(len(prompts))]
            if self.score is not None:
                with self.score_lock:
                    try:
                        scores = list(self.score(groups))
                    except Exception as exc:  # noqa: BLE001 - the user's scorer, named
                        raise ConfigError(
                            f"score: failed on the groups of prompts {first}.."
                            f"{first + len(prompts) - 1}: {type(exc).__name__}: {exc}") from exc
                if len(scores) != len(groups):
                    raise ConfigError(f"score: must return one result per group, got "
                                      f"{len(scores)} for {len(groups)} groups (prompts "
                                      f"{first}..{first + len(prompts) - 1})")
                groups = [attrs.evolve(g, score=s) for g, s in zip(groups, scores)]
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer by next_batch
            self.balancer.done(url, work)
            error = exc if isinstance(exc, (WeightSyncError, ConfigError)) else WeightSyncError(
                f"rollout stream: request for prompts {first}..{first + len(prompts) - 1} to "
                f"{url} failed: {type(exc).__name__}: {exc}")
            with self.cond:
                self.error = self.error or error
                self.cond.notify_all()
            return
        self.balancer.done(url, work)
        with self.cond:
            if self.closed:  # answers after close() are dropped
                return
            for g in groups:
                self.finished[g.index] = g
            self.cond.notify_all()


def staleness(version: int, pushed: Sequence[int]) -> int:
    """How many pushes before the last of ``pushed`` (the versions served after each advance,
    in order) a token of ``version`` was sampled: the index of the last push serving a version
    <= it, counted back from the end; a version older than the first is counted in versions."""
    at = bisect.bisect_right(pushed, version) - 1
    return len(pushed) - 1 - at if at >= 0 else len(pushed) - 1 + pushed[0] - version


def _stats(groups: list, pushed: list, waited: float, held: float) -> dict:
    """A step's stream statistics (StreamBatch); ``pushed``: the versions served after each
    advance so far, the last the one trained."""
    version = pushed[-1]
    stale, tokens, off = [], 0, 0
    for g in groups:
        for o in g.outputs:
            versions = token_versions(o)
            if versions:
                stale.append(staleness(min(versions), pushed))
            tokens += len(versions)
            off += sum(v < version for v in versions)
    sent = [g.sent for g in groups if g.sent is not None]
    answered = [g.answered for g in groups if g.answered is not None]
    return {"staleness_mean": sum(stale) / len(stale) if stale else 0.0,
            # from the first request sent to the last answered: generation of the step's samples,
            # overlapped with training (trainer_wait_seconds is what the trainer paid for it)
            "generation_span_seconds": max(answered) - min(sent) if sent and answered else 0.0,
            "staleness_max": max(stale) if stale else 0,
            "off_policy_token_frac": off / tokens if tokens else 0.0,
            "trainer_wait_seconds": waited, "rollout_wait_seconds": held}
