"""Rollout workflows: one user function per sample, for multi-turn and agentic episodes.

    rollout: {workflow: my_agents:solve}          # YAML

    async def solve(client, row):                  # or a plain def
        reply = await client.chat.completions.create(model="policy", messages=[...])
        ...                                        # tools, environment steps, more calls
        return 1.0                                 # the episode's reward (or one per turn)

``client`` is an ``openai.AsyncOpenAI`` (``openai.OpenAI`` for a plain function) bound to the
rollout server that records every completion's exact token ids, behav_logp and weight versions
(fsdpfn.rollout.agent); ``row`` is the data row (a dict). The episode's turns become training rows
by fsdpfn.rollout.episode (joined where each turn extends the context, loss on sampled tokens
only). Group statistics (GRPO) are taken over the ``group_size`` episodes of one data row, and
every row of an episode carries the episode's advantage.

A workflow that raises, hangs past ``timeout_s``, returns something that is not a reward or
makes no request through its client scores ``on_error``, is counted and described, and the run
goes on; the turns it made before failing are trained with that reward. A step whose every
episode failed stops the run, and so does a turn drawn at another temperature than
ppo.temperature (check_episodes). A row longer than the data limits is dropped and counted,
never cut.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import math
import numbers
import threading
import time
from typing import Any, Callable

import attrs
import torch
from tensordict import TensorDict

from fsdpfn import keys as K
from fsdpfn.errors import ConfigError
from fsdpfn.ops import group_advantages
from fsdpfn.app.recipes import _reward_worker as W
from fsdpfn.rollout.errors import PAST_POSITIONS
from fsdpfn.rollout.episode import episode_rows
from fsdpfn.validators import FLOAT32_MAX

__all__ = ["Workflow", "load_workflow", "EpisodeResult", "run_episodes", "episodes_batch",
           "check_episodes", "to_reward"]


@attrs.frozen
class Workflow:
    fn: Callable
    is_async: bool
    spec: str


def load_workflow(spec: str, *, key: str = "rollout.workflow") -> Workflow:
    """The function named by ``spec`` ("pkg.mod:fn" or "path/file.py:fn"), checked to take
    (client, row); ConfigError names ``key``, what fails and the spec."""
    try:
        import openai  # noqa: F401 - the client workflows are handed
    except ImportError:
        raise ConfigError(f"{key}: workflows need the openai package: pip install "
                          f"'fsdpfn[agents]', got {spec!r}") from None
    try:
        fn = W.resolve(spec)
    except W.SpecError as exc:
        raise ConfigError(f"{key}: {exc}, got {spec!r}") from None
    try:
        inspect.signature(fn).bind(object(), {})
    except TypeError as exc:
        raise ConfigError(f"{key}: must be callable as fn(client, row), got {spec!r} with "
                          f"signature {inspect.signature(fn)} ({exc})") from None
    except ValueError:  # no signature to read (a builtin): let the first call tell
        pass
    if W.yields(fn):
        raise ConfigError(f"{key}: must return the episode's reward, not yield it (calling a "
                          f"generator function returns a generator, not a reward), got {spec!r}")
    call = getattr(fn, "__call__", None)  # an object whose __call__ is the workflow
    is_async = inspect.iscoroutinefunction(fn) or (
        not inspect.isfunction(fn) and inspect.iscoroutinefunction(call))
    return Workflow(fn, is_async, spec)


def to_reward(value, n_turns: int) -> float:
    """A workflow's return value as the episode's reward: a finite number or bool (a 0-d tensor
    or array of one too), or one per turn (summed); anything else raises ValueError naming what
    was returned."""
    if isinstance(value, (list, tuple)):
        if len(value) != n_turns:
            raise ValueError(f"returned {len(value)} rewards for {n_turns} turns (one per turn, "
                             f"or one number)")
        total = float(sum(to_reward(v, 1) for v in value))
        if abs(total) > FLOAT32_MAX:
            raise ValueError(f"returned per-turn rewards summing to {total!r}, past float32's "
                             f"range (|x| <= 3.4e38: the batch holds rewards in float32)")
        return total
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # a 0-d tensor or array
        value = value.item()
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, numbers.Real) and math.isfinite(value) and abs(value) <= FLOAT32_MAX:
        return float(value)
    if inspect.isawaitable(value):
        if inspect.iscoroutine(value):
            value.close()  # never awaited: no "was never awaited" warning on top of this line
        raise ValueError(f"returned an awaitable ({type(value).__name__}) from a plain call: "
                         f"declare the workflow `async def` (or its class's __call__) so that "
                         f"it is awaited and handed the async client")
    raise ValueError(f"must return a finite number within float32's range (|x| <= 3.4e38: the "
                     f"batch holds rewards in float32), a bool or one per turn, got "
                     f"{repr(value)[:200]} ({type(value).__name__})")


@attrs.frozen
class EpisodeResult:
    """One episode: the data row it answers (``index``: its position in the run's data order,
    unique within a step), its turns, its reward, why it failed (None when it did not), and the
    row's own ``index`` in the data files where it has one (``row_index``)."""

    index: int
    turns: list
    reward: float
    error: str | None
    seconds: float
    row_index: int | None = None

    @property
    def where(self) -> str:
        """The data row as messages name it: the row of the data files a user can look up."""
        if self.row_index is None or self.row_index == self.index:
            return f"data row {self.index}"
        return f"data row {self.row_index} (position {self.index} of the run's data order)"


NO_TURN = ("made no request through the client it was given (only that client's completions "
           "are recorded: a client of its own trains nothing)")


def _finish(job, client, value, error, on_error, t0) -> EpisodeResult:
    index, row = job
    turns = list(client.turns)
    if error is None:
        try:
            reward = to_reward(value, len(turns))
        except ValueError as exc:
            error = str(exc)
    if error is None and not turns:
        error = NO_TURN
    if error is not None:
        reward = on_error
    own = row.get("index") if isinstance(row, dict) else None
    return EpisodeResult(index, turns, reward, error, time.perf_counter() - t0,
                         own if isinstance(own, int) and not isinstance(own, bool) else None)


# what a decode loop's refusal of a call past its positions (PAST_POSITIONS) adds: a later
# turn's prompt holds the turns before it, and the key that sizes the positions is the run's
POSITIONS_HINT = ("; a later turn's prompt holds the turns before it: set "
                  "rollout.max_episode_tokens to the longest episode (the servers fsdpfn run "
                  "starts take it as their --decode-max-len)")


def _describe(exc: BaseException, timeout_s: float) -> str:
    if isinstance(exc, (asyncio.TimeoutError, concurrent.futures.TimeoutError)):
        return f"timeout: no result within {timeout_s} s"
    text = f"raised {W.describe(exc)}"
    return text + POSITIONS_HINT if PAST_POSITIONS in text else text


async def _run_async(url, workflow, jobs, seeds, timeout_s, on_error) -> list[EpisodeResult]:
    from fsdpfn.rollout.agent import AsyncEpisodeClient

    async def one(job, seed):
        client = AsyncEpisodeClient(url, timeout=timeout_s, seed=seed)
        t0 = time.perf_counter()
        try:
            value = await asyncio.wait_for(workflow.fn(client, dict(job[1])), timeout_s)
            return _finish(job, client, value, None, on_error, t0)
        except Exception as exc:  # noqa: BLE001 - scored on_error, described, the run goes on
            return _finish(job, client, None, _describe(exc, timeout_s), on_error, t0)
        finally:
            await client.close()

    # One loop pass after each start, so that an episode's first request goes out while the
    # next ones are being built: started all at once, every episode built its request before
    # any was sent, the server idled meanwhile, and all answers came back together to be read
    # after its last step (1.6 to 1.8 s outside the steps against 0.4; BENCHMARKS.md,
    # "Rollout workflows").
    tasks = []
    for job, seed in zip(jobs, seeds):
        tasks.append(asyncio.ensure_future(one(job, seed)))
        await asyncio.sleep(0)
    return list(await asyncio.gather(*tasks))


def _run_sync(url, workflow, jobs, seeds, timeout_s, on_error) -> list[EpisodeResult]:
    from fsdpfn.rollout.agent import EpisodeClient

    clients = [EpisodeClient(url, timeout=timeout_s, seed=seed) for seed in seeds]
    t0 = time.perf_counter()
    futures = [_on_daemon_thread(workflow.fn, c, dict(row)) for c, (_, row) in zip(clients, jobs)]
    out = []
    for job, client, future in zip(jobs, clients, futures):
        try:
            left = max(0.0, timeout_s - (time.perf_counter() - t0))
            out.append(_finish(job, client, future.result(left), None, on_error, t0))
        except Exception as exc:  # noqa: BLE001 - scored on_error, described, the run goes on
            out.append(_finish(job, client, None, _describe(exc, timeout_s), on_error, t0))
    for client in clients:  # a hung workflow's next call fails instead of reaching the server
        client.close()
    return out


def _on_daemon_thread(fn, *args) -> concurrent.futures.Future:
    """``fn(*args)`` on a daemon thread of its own. A plain-def workflow that never returns is
    abandoned after its timeout; on a ThreadPoolExecutor's worker it would still hold the
    process at exit (the executor joins its workers then), so the run could not end."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller through the future
            future.set_exception(exc)

    threading.Thread(target=run, name="fsdpfn-workflow", daemon=True).start()
    return future


def run_episodes(url: str, workflow: Workflow, rows: list[dict], group_size: int, *,
                 first: int = 0, timeout_s: float = 600.0, on_error: float = 0.0,
                 seed: int | None = None) -> list[EpisodeResult]:
    """``group_size`` episodes of every data row, all at once; results row-major (the episodes
    of rows[i] are results[i*G:(i+1)*G]). ``first``: the data row of rows[0], so that each
    result's ``index`` is its row in the data (what errors name and ``group_id`` carries: one
    step's rows run as several requests, one a server, and must not share numbers). ``seed``:
    episode j of data row d is seeded row_seed(seed, d, j) (its calls then draw from
    fsdpfn.rollout.agent.call_seed of it), whichever server or request runs it; None: unseeded."""
    from fsdpfn.rollout.device_sampling import row_seed

    jobs = [(first + i, row) for i, row in enumerate(rows) for _ in range(group_size)]
    seeds = [None if seed is None else row_seed(seed, first + i, j)
             for i in range(len(rows)) for j in range(group_size)]
    if workflow.is_async:
        return asyncio.run(_run_async(url, workflow, jobs, seeds, timeout_s, on_error))
    return _run_sync(url, workflow, jobs, seeds, timeout_s, on_error)


def check_episodes(results: list[EpisodeResult], spec: str, temperature: float) -> None:
    """The rules a step's episodes must meet to be trained on, else ConfigError in one line
    naming the workflow: every turn drawn at ``temperature`` (ppo.temperature: a turn's
    behav_logp are log_softmax(logits / its temperature), the trainer's at ``temperature``;
    greedy turns, 0, are no samples of the policy), and not every episode failed."""
    for r in results:
        for turn in r.turns:
            t = turn.temperature
            if t is not None and not math.isclose(t, temperature, rel_tol=1e-6, abs_tol=1e-9):
                drawn = "greedily (temperature 0)" if t == 0 else f"at temperature {t:g}"
                raise ConfigError(
                    f"rollout.workflow: {spec} sampled a turn {drawn} for {r.where}, "
                    f"but ppo.temperature is {temperature:g}: its behav_logp are not the "
                    f"trained policy's; sample every turn at temperature {temperature:g} (a "
                    f"call without one samples at 1), or set ppo.temperature")
    if results and all(r.error is not None for r in results):
        first = results[0]
        raise ConfigError(f"rollout.workflow: every episode of the step failed ({len(results)}); "
                          f"{spec} on {first.where}: {first.error}")


def episodes_batch(results: list[EpisodeResult], group_size: int, *, max_tokens: int,
                   estimator: str = "grpo",
                   eps: float = 1e-6) -> tuple[TensorDict | None, dict[str, Any]]:
    """The public batch of a step's episodes: their rows (fsdpfn.rollout.episode) with
    ``behav_logp``, ``rewards`` (the episode's, per row), ``advantages`` (``estimator``, as
    compute_advantages computes it, over each data row's episodes, on the row's loss tokens) and
    ``group_id`` (the data row); None when no episode left a row. Rows over ``max_tokens`` are
    dropped and counted in the stats."""
    rewards = torch.tensor([r.reward for r in results], dtype=torch.float32)
    if estimator not in ("grpo", "drgrpo", "rloo"):
        raise ConfigError(f"advantage.estimator: episodes are grouped per data row, so it must "
                          f"be 'grpo', 'drgrpo' or 'rloo', got {estimator!r}")
    adv = group_advantages(rewards, group_size, norm_std=estimator == "grpo",
                           leave_one_out=estimator == "rloo", eps=eps)
    rows, owners, dropped = [], [], 0
    for k, result in enumerate(results):
        for row in episode_rows(result.turns):
            if len(row.input_ids) > max_tokens:
                dropped += 1
                continue
            rows.append(row)
            owners.append(k)
    stats = {"episodes": len(results), "episode_rows": len(rows),
             "episode_rows_dropped": dropped,
             "episode_errors": sum(r.error is not None for r in results),
             "turns_per_episode": sum(len(r.turns) for r in results) / max(len(results), 1)}
    if not rows:
        return None, stats
    T = max(len(r.input_ids) for r in rows)
    B = len(rows)
    ids = torch.zeros(B, T, dtype=torch.long)
    attn, loss = torch.zeros(B, T, dtype=torch.bool), torch.zeros(B, T, dtype=torch.bool)
    behav = torch.zeros(B, T)
    for b, row in enumerate(rows):
        n = len(row.input_ids)
        ids[b, :n] = torch.tensor(row.input_ids)
        attn[b, :n] = True
        loss[b, :n] = torch.tensor(row.loss_mask)
        behav[b, :n] = torch.tensor(row.behav_logp)
    owner = torch.tensor(owners)
    batch = TensorDict({K.INPUT_IDS: ids, K.ATTENTION_MASK: attn, K.LOSS_MASK: loss,
                        K.BEHAV_LOGP: behav, K.REWARDS: rewards[owner],
                        K.ADVANTAGES: torch.where(loss, adv[owner][:, None], 0.0),
                        K.GROUP_ID: torch.tensor([results[k].index for k in owners])},
                       batch_size=[B])
    return batch, stats
