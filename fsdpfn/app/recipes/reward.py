"""The user's reward for the ``fsdpfn run`` recipes: its config, its loading, and a worker pool.

    reward:
      fn: my_pkg.rewards:score        # or path/to/file.py:score; None: the task's built-in reward
      batched: false
      workers: 4                      # processes; 0 runs in-process (debugging, no timeout)
      timeout_s: 10                   # per call: per sample, or per batch when batched
      on_error: 0.0                   # the reward of a sample whose call failed
      kwargs: {tolerance: 1.0e-6}     # passed to the function as keyword arguments

The signature, per sample (``batched: false``; ``sample`` is the dataset row the prompt came
from, ``answer`` its reference answer or None, ``kwargs`` is ``reward.kwargs``)::

    def score(prompt: str, completion: str, *, answer: str | None, sample: dict,
              **kwargs) -> float

and batched (``batched: true``, one call per batch of rows)::

    def score(prompts: list[str], completions: list[str], *, answers: list, samples: list[dict],
              **kwargs) -> list[float]

A reward may carry a one-time set-up as an attribute, ``score.prepare = fn`` (no arguments): each
worker runs it once when it loads the reward, before any call and outside the timeouts (the
built-in ``math`` imports math-verify so).

A bool (numpy's too) counts as 0/1, a finite real number within float32's range (|x| <=
3.4e38, as the batch holds it) as itself; anything else (NaN, inf, 1e39, a string, None, a list
of the wrong length) is an ``invalid`` error for that sample.

The spec is resolved in the launcher, before any rank starts: a module that does not import, a
missing attribute or a non-callable raises ConfigError naming ``reward.fn`` and the value.

Failures never stop the run. RewardPool calls the function in worker processes, each call with a
timeout; a call that raises (``exception``), exceeds ``timeout_s`` (``timeout``) or returns a
non-number (``invalid``) scores ``on_error`` and is reported in RewardResult.errors with its index,
message, prompt and completion (truncated), and counted. A timed-out or dead worker is killed and
replaced by a fresh one at once, so the next calls run at full speed. A worker dies with the
process that started it, even in the middle of a call (fsdpfn.wire.lifeline.exit_with_parent).

Batched failures: an exception or a timeout fails the whole batch (every sample scores
``on_error`` and carries the batch's error); there is no retry, since retrying a hang multiplies
the wait and a batched reward (often a remote service) is best made to catch its own per-sample
failures. A returned list of the right length with a bad element fails only that element.

Workers are fresh interpreters (``python -P fsdpfn/app/recipes/_reward_worker.py``, started with
subprocess): never a fork of the caller, which is a torch process with threads. They import only
the reward's module (the built-in rewards without torch), and receive the caller's ``sys.path``,
so a module the launcher can import, the workers can too. ``workers=0`` calls the function in the
calling process: exceptions and invalid values are still caught, but a hang hangs the run.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as wait_any
from typing import Any, Callable

import attrs

from fsdpfn.validators import boolean, integer, number, satisfies, to_float
from fsdpfn.errors import ConfigError
from fsdpfn.app.recipes import _reward_worker as W

__all__ = ["RewardConfig", "RewardFailure", "RewardResult", "RewardPool", "load_reward",
           "build_reward_pool", "reward_spec", "DEFAULT_REWARDS", "KINDS"]

KINDS = ("exception", "timeout", "invalid")
# reward.fn: null means the task's own: exact sums on the embedded task, math answers on files
DEFAULT_REWARDS = {"embedded": "fsdpfn.app.recipes.rewards:addition",
                   "files": "fsdpfn.app.recipes.rewards:math"}
STARTUP_TIMEOUT_S = 120.0  # a worker must import the reward's module within this
_WORKER_FILE = W.__file__
_CLIP = 200


def reward_spec(cfg) -> str:
    """The reward a recipe config scores with: ``reward.fn``, else its task's own."""
    if cfg.reward.fn is not None:
        return cfg.reward.fn
    return DEFAULT_REWARDS["files" if cfg.data.from_files else "embedded"]


# ---------------------------------------------------------------- config and loading


def _is_spec(value) -> bool:
    try:
        W.split_spec(value)
    except W.SpecError:
        return False
    return True


_spec = satisfies(f"{W.FORMAT_RULE} (or None)", _is_spec, optional=True)
_kwargs = satisfies("must be a mapping with string keys",
                    lambda v: isinstance(v, dict) and all(isinstance(k, str) for k in v))


@attrs.frozen
class RewardConfig:
    """The user's reward (see the module docstring for the signature): ``fn`` is
    "package.module:function" or "path/to/file.py:function" (None: the task's built-in reward),
    called in ``workers`` processes (0: in-process) with ``timeout_s`` per call; a failed call
    scores ``on_error``. ``kwargs`` are passed to the function."""

    fn: str | None = attrs.field(default="fsdpfn.app.recipes.rewards:math", validator=_spec)
    batched: bool = attrs.field(default=False, validator=boolean)
    workers: int = attrs.field(default=4, validator=integer(0))
    timeout_s: float = attrs.field(default=10.0, converter=to_float, validator=number(gt=0))
    on_error: float = attrs.field(default=0.0, converter=to_float, validator=number())
    kwargs: dict = attrs.field(factory=dict, validator=_kwargs, hash=False)


def load_reward(spec: str, *, key: str = "reward.fn") -> Callable:
    """The function named by ``spec`` ("pkg.mod:fn" or "path/to/file.py:fn"); ConfigError names
    ``key``, what fails (import, attribute, callable) and the spec."""
    try:
        return W.resolve(spec)
    except W.SpecError as exc:
        raise ConfigError(f"{key}: {exc}, got {spec!r}") from None


def _spec_of(fn: Callable, key: str) -> str:
    """'module:qualname' of a function that worker processes can import by name."""
    spec = f"{getattr(fn, '__module__', None)}:{getattr(fn, '__qualname__', '?')}"
    if "<" in spec or spec.startswith(("None:", "__main__:")):
        raise ConfigError(f"{key}: a callable run in worker processes must be importable as "
                          f"'module:function' (or use workers=0), got {spec!r}")
    if load_reward(spec, key=key) is not fn:
        raise ConfigError(f"{key}: {spec!r} does not import as the callable given, got {fn!r}")
    return spec


def build_reward_pool(cfg: RewardConfig, *, default: Callable | str | None = None) -> RewardPool:
    """The pool of ``cfg``; ``default`` (the task's built-in reward) stands in for fn=None."""
    fn = cfg.fn if cfg.fn is not None else default
    if fn is None:
        raise ConfigError("reward.fn: None means the task's built-in reward, and this task has "
                          "none; name a function 'package.module:function', got None")
    return RewardPool(fn, batched=cfg.batched, workers=cfg.workers, timeout_s=cfg.timeout_s,
                      on_error=cfg.on_error, kwargs=cfg.kwargs)


# ---------------------------------------------------------------- results


def _clip(text: Any, limit: int = _CLIP) -> str:
    """Head and tail of a long text (a completion's answer is at its end)."""
    text = text if isinstance(text, str) else repr(text)
    if len(text) <= limit:
        return text
    half = (limit - 5) // 2
    return f"{text[:half]} ... {text[-half:]}"


@attrs.frozen
class RewardFailure:
    """One sample whose reward call failed: ``kind`` is one of KINDS."""

    index: int
    kind: str
    message: str
    prompt: str
    completion: str

    def __str__(self) -> str:
        return (f"sample {self.index}: {self.kind}: {self.message} | prompt {self.prompt!r} | "
                f"completion {self.completion!r}")


@attrs.frozen
class RewardResult:
    """``rewards[i]`` of every sample (``on_error`` where it failed), the failures, the time."""

    rewards: list[float]
    errors: list[RewardFailure]
    seconds: float

    @property
    def counts(self) -> dict[str, int]:
        return {kind: sum(e.kind == kind for e in self.errors) for kind in KINDS}

    def metrics(self) -> dict[str, float]:
        """Numbers for a metrics row: reward_errors and one count per kind, reward_seconds."""
        row = {"reward_errors": len(self.errors), "reward_seconds": self.seconds}
        row.update({f"reward_{kind}": n for kind, n in self.counts.items()})
        return row

    def summary(self, max_errors: int = 3) -> str:
        """'2 of 16 rewards failed (exception 1, timeout 1, invalid 0)' and the first failures."""
        if not self.errors:
            return f"{len(self.rewards)} rewards, no failures"
        counts = ", ".join(f"{k} {n}" for k, n in self.counts.items())
        lines = [f"{len(self.errors)} of {len(self.rewards)} rewards failed ({counts})"]
        lines += [f"  {e}" for e in self.errors[:max_errors]]
        return "\n".join(lines)


# ---------------------------------------------------------------- the worker pool


@attrs.define(eq=False)
class _Worker:
    proc: subprocess.Popen
    conn: Connection
    deadline: float
    starting: bool = True
    task: list[int] | None = None  # the sample indices of the request in flight


def _stop(worker: _Worker) -> None:
    if worker.proc.poll() is None:
        worker.proc.kill()
    worker.proc.wait()
    worker.conn.close()


def _stop_all(workers: list[_Worker]) -> None:
    for worker in workers:
        _stop(worker)
    workers.clear()


class RewardPool:
    """Calls a reward function in worker processes with a per-call timeout (module docstring).

        with RewardPool("my_pkg.rewards:score", workers=4, timeout_s=10) as pool:
            result = pool.score(prompts, completions, answers=answers, samples=rows)
            rewards = result.rewards          # floats; on_error where result.errors says why

    ``fn`` is a spec string or a callable (importable by name unless workers=0). The spec is
    resolved here, in the calling process: a bad one raises ConfigError before anything runs.
    Workers start on ``start()`` / ``with`` (or the first ``score``). Not thread-safe.
    """

    def __init__(self, fn: str | Callable, *, batched: bool = False, workers: int = 4,
                 timeout_s: float = 10.0, on_error: float = 0.0, kwargs: dict | None = None):
        self._fn = fn if callable(fn) else load_reward(fn)
        spec = fn if isinstance(fn, str) else None
        self.config = RewardConfig(fn=spec, batched=batched, workers=workers, timeout_s=timeout_s,
                                   on_error=on_error, kwargs=dict(kwargs or {}))
        if spec is None and workers > 0:
            spec = _spec_of(fn, "reward.fn")
        self._spec = spec
        self._workers: list[_Worker] = []
        self._closed = False
        self._finalizer = weakref.finalize(self, _stop_all, self._workers)

    # -- lifecycle

    def __enter__(self) -> RewardPool:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> None:
        """Start the workers and wait until each has imported the reward (no-op for workers=0)."""
        if self._closed:
            raise RuntimeError("RewardPool: used after close()")
        n = 0 if self.config.workers == 0 else (1 if self.config.batched else self.config.workers)
        while len(self._workers) < n:
            self._workers.append(self._spawn())
        while any(w.starting for w in self._workers):
            self._collect({})

    def close(self) -> None:
        """Ask idle workers to exit (2 s), kill busy ones; the pool cannot be used afterwards."""
        self._closed = True
        for w in self._workers:
            if w.task is None:  # a starting worker reads it after loading the reward
                try:
                    w.conn.send(None)
                except OSError:
                    pass
        end = time.monotonic() + 2.0
        for w in self._workers:
            try:
                w.proc.wait(timeout=max(end - time.monotonic(), 0.01))
            except subprocess.TimeoutExpired:
                pass
        self._finalizer()  # kills what is left

    @property
    def pids(self) -> list[int]:
        """Process ids of the live workers (for tests and monitoring)."""
        return [w.proc.pid for w in self._workers]

    # -- scoring

    def score(self, prompts: list[str], completions: list[str], *, answers: list | None = None,
              samples: list[dict] | None = None) -> RewardResult:
        """Rewards of ``completions[i]`` to ``prompts[i]``, with ``answers[i]`` (default None)
        and the dataset rows ``samples[i]`` (default {}). Failures are in the result."""
        t0 = time.monotonic()
        n = len(prompts)
        answers = [None] * n if answers is None else list(answers)
        samples = [{} for _ in range(n)] if samples is None else list(samples)
        for name, values in (("completions", completions), ("answers", answers),
                             ("samples", samples)):
            if len(values) != n:
                raise ValueError(f"RewardPool.score: {name} must have one entry per prompt "
                                 f"({n}), got {len(values)}")
        requests = self._requests(list(prompts), list(completions), answers, samples)
        run = self._run_local if self.config.workers == 0 else self._run
        outcomes = run(requests) if requests else {}
        return self._result(outcomes, prompts, completions, time.monotonic() - t0)

    def _requests(self, prompts, completions, answers, samples) -> list[tuple[list[int], tuple]]:
        if self.config.batched:
            return [(list(range(len(prompts))), ("batch", prompts, completions, answers, samples))]
        return [([i], ("one", p, c, a, s))
                for i, (p, c, a, s) in enumerate(zip(prompts, completions, answers, samples))]

    def _run_local(self, requests) -> dict[int, tuple]:
        outcomes = {}
        for indices, request in requests:
            outcomes.update(zip(indices, W.call(self._fn, request, self.config.kwargs)))
        return outcomes

    def _result(self, outcomes, prompts, completions, seconds) -> RewardResult:
        rewards, errors = [], []
        for i in range(len(prompts)):
            kind, value = outcomes[i]
            if kind == "ok":
                rewards.append(value)
                continue
            rewards.append(self.config.on_error)
            errors.append(RewardFailure(i, kind, _clip(value, 1000), _clip(prompts[i]),
                                        _clip(completions[i])))
        return RewardResult(rewards, errors, seconds)

    # -- the event loop: dispatch to idle workers, collect results, expire deadlines

    def _run(self, requests) -> dict[int, tuple]:
        if not self._workers:
            self.start()
        outcomes: dict[int, tuple] = {}
        pending = deque(requests)
        try:
            while pending or any(w.task is not None for w in self._workers):
                self._dispatch(pending, outcomes)
                self._collect(outcomes)
        except BaseException:
            # a busy worker's answer would arrive during the next call: replace it
            for i, w in enumerate(self._workers):
                if w.task is not None or w.starting:
                    _stop(w)
                    self._workers[i] = self._spawn()
            raise
        return outcomes

    def _dispatch(self, pending: deque, outcomes: dict) -> None:
        for i, w in enumerate(self._workers):
            if not pending:
                return
            if w.starting or w.task is not None:
                continue
            indices, request = pending.popleft()
            w.task, w.deadline = indices, time.monotonic() + self.config.timeout_s
            try:
                w.conn.send(request)
            except OSError:  # it died while idle
                self._fail(i, outcomes, "exception", self._death(w))

    def _collect(self, outcomes: dict) -> None:
        """Wait for the first message or deadline; handle every worker that has one."""
        active = [w for w in self._workers if w.starting or w.task is not None]
        if not active:
            return
        timeout = max(min(w.deadline for w in active) - time.monotonic(), 0.0)
        ready = wait_any([w.conn for w in active], timeout)
        for w in active:
            if w.conn in ready:
                self._receive(self._workers.index(w), outcomes)
        now = time.monotonic()
        for i, w in enumerate(self._workers):
            if (w.starting or w.task is not None) and w.deadline <= now:
                self._expire(i, outcomes)

    def _receive(self, i: int, outcomes: dict) -> None:
        w = self._workers[i]
        try:
            message = w.conn.recv()
        except (EOFError, OSError):
            if w.starting:
                raise ConfigError(f"reward.fn: a worker process exited while loading it "
                                  f"({self._death(w)}), got {self._spec!r}") from None
            return self._fail(i, outcomes, "exception", self._death(w))
        if not w.starting:
            outcomes.update(zip(w.task, message))
            w.task = None
        elif message[0] == "ready":
            w.starting = False
        else:
            raise ConfigError(f"reward.fn: a worker process cannot load it ({message[1]}), "
                              f"got {self._spec!r}")

    def _expire(self, i: int, outcomes: dict) -> None:
        w = self._workers[i]
        if w.starting:
            raise ConfigError(f"reward.fn: a worker process did not load it within "
                              f"{STARTUP_TIMEOUT_S} s, got {self._spec!r}")
        self._fail(i, outcomes, "timeout",
                   f"no result within timeout_s={self.config.timeout_s} s (the worker was "
                   f"killed and replaced)")

    def _fail(self, i: int, outcomes: dict, kind: str, message: str) -> None:
        """Score the worker's request as failed and replace the worker by a fresh one."""
        w = self._workers[i]
        outcomes.update((j, (kind, message)) for j in w.task)
        _stop(w)
        self._workers[i] = self._spawn()

    @staticmethod
    def _death(w: _Worker) -> str:
        try:
            code = w.proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            code = None
        return f"the worker process died (exit code {code})"

    def _spawn(self) -> _Worker:
        parent, child = socket.socketpair()
        try:
            # the worker ties itself to this process (the kernel's parent-death signal is
            # bound to the forking thread: only safe from the main thread)
            forker = "main" if threading.current_thread() is threading.main_thread() else "thread"
            proc = subprocess.Popen([sys.executable, "-P", _WORKER_FILE, str(child.fileno()),
                                     str(os.getpid()), forker],
                                    pass_fds=(child.fileno(),), stdin=subprocess.DEVNULL)
        finally:
            child.close()
        conn = Connection(parent.detach())
        conn.send({"sys_path": list(sys.path), "spec": self._spec,
                   "kwargs": dict(self.config.kwargs)})
        return _Worker(proc, conn, deadline=time.monotonic() + STARTUP_TIMEOUT_S)
