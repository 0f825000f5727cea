"""What every recipe's ranks share: the run context, a clean stop on SIGINT, metrics as JSON
lines, a progress bar on stderr, and checkpoint bookkeeping.

A stop is cooperative: SIGINT/SIGTERM only set a flag; at the end of each step all ranks agree
(one all-reduce) whether any rank was asked to stop, then stop together after the step, so a
checkpoint is never cut short (and checkpoints are atomic anyway).
"""

from __future__ import annotations

import io
import json
import math
import secrets
import os
import signal
import sys
import time
from pathlib import Path

import attrs
import torch
import torch.distributed as dist

from fsdpfn.engine.host import available_host_memory
from fsdpfn.agree import is_rank_zero

__all__ = ["RunContext", "StopFlag", "Metrics", "Progress", "Checkpoints", "log", "is_main",
           "wandb_run", "broadcast_from_main", "all_reduce_sum", "mean_sequence_prob"]


def is_main() -> bool:
    """Rank 0 (or no process group): the rank that logs, talks to the servers and scores."""
    return is_rank_zero()


def log(message: str) -> None:
    """One line on stderr from rank 0."""
    if is_main():
        print(f"[fsdpfn] {message}", file=sys.stderr, flush=True)


class StopFlag:
    """Set by SIGINT/SIGTERM; ``agreed()`` is True on every rank once any rank has it set."""

    def __init__(self):
        self.requested = False
        self.signal_name: str | None = None

    def install(self) -> "StopFlag":
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._handler)
        return self

    def _handler(self, signum, frame) -> None:
        self.requested = True
        self.signal_name = signal.Signals(signum).name

    def agreed(self) -> bool:
        flag = torch.tensor([1 if self.requested else 0], dtype=torch.int64)
        return bool(all_reduce_sum(flag, op=dist.ReduceOp.MAX).item())


def all_reduce_sum(x: torch.Tensor, group=None, op=None) -> torch.Tensor:
    """A host tensor reduced over ``group`` (None: the world, when there is more than one
    rank); through the device when the group's backend is NCCL."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return x
    backend = dist.get_backend(group)
    y = x.to(torch.device("cuda", torch.cuda.current_device())) if backend == "nccl" else x
    dist.all_reduce(y, op=op or dist.ReduceOp.SUM, group=group)
    return y.cpu()


def broadcast_from_main(fn):
    """Run ``fn()`` on rank 0 and give its result to every rank; an exception on rank 0 is
    raised on every rank (so no rank waits forever in a collective)."""
    payload = [None]
    if is_main():
        try:
            payload[0] = ("ok", fn())
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
            payload[0] = ("err", exc)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(payload, src=0)
    kind, value = payload[0]
    if kind == "err":
        raise value
    return value


@attrs.frozen
class RunContext:
    """What the launcher tells the ranks (from the worker's command line)."""

    run_dir: Path
    resume: bool = False
    rollout_url: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    transport: str = "broadcast"
    stop: StopFlag = attrs.field(factory=StopFlag)

    @property
    def rollout_urls(self) -> list[str]:
        """Every rollout server's URL (``rollout_url`` may name several, comma-separated)."""
        return [u for u in (self.rollout_url or "").split(",") if u]


def step_stats(stats, *, skip=()) -> dict:
    """A step function's stats as a metrics row's floats (the time_* parts, peak_memory_gb,
    lr, steps, skipped, ...), nested keys joined by "/"; ``skip``: keys the row names itself."""
    out = {}
    for key in stats.keys():
        name = key if isinstance(key, str) else "/".join(key)
        if name not in skip:
            out[name] = float(stats[key])
    return out


def with_checkpoint(row: dict) -> dict:
    """A step's row with its checkpoint counted in the step: ``seconds`` the whole step, the
    save it was blocked by included, and ``tokens_per_s`` over it."""
    if row.get("checkpoint_seconds"):
        row["seconds"] = row.get("seconds", 0.0) + row["checkpoint_seconds"]
        if row.get("tokens"):
            row["tokens_per_s"] = row["tokens"] / row["seconds"]
    return row


class Checkpoints:
    """The recipe's checkpoint saves (``cfg.checkpoint``), at most one in flight.

    ``save(items, final=...)`` at the end of a step, ``poll()`` after the other steps, ``wait()``
    before the run ends; each returns that step's metrics. With ``async_save`` a save returns
    once the state's shards are copied to host memory and publishes in the background; the next
    save waits for it first, and a ``final`` save (the end of the run, a clean stop) is written
    directly. Rows name only published checkpoints: ``checkpoint`` (the newest published by
    the row's step) and its ``checkpoint_write_seconds`` (its start to its publication), and
    ``checkpoints_published`` every one a save published at that step (the save in flight,
    which a new save waits for, and the new one when it is written directly).
    Collective: every rank calls every method at the same step.
    """

    def __init__(self, cfg):
        self.async_save, self.keep_last = cfg.async_save, cfg.keep_last
        self._pending: tuple[Path, float, list] | None = None  # (path, start, handles)
        self._warned = False
        # bytes a save copies: the states' shard layout is fixed for the run, so it is counted
        # once (counting builds their state dicts, as the save itself does)
        self._copy: int | None = None

    def save(self, items, *, final: bool) -> dict:
        """Save ``items`` [(state, path, extra)] in order of publication (a later one implies
        the earlier ones: the policy after its critic). Returns the step's metrics."""
        import fsdpfn as ff

        t0 = time.perf_counter()
        row = self.wait()  # the save in flight publishes first: named in this row too
        earlier = row.get("checkpoint")
        if self._copy is None:
            from fsdpfn.checkpoint.save import copy_bytes

            self._copy = sum(copy_bytes(state) for state, _, _ in items)
        copy = self._copy
        t1 = time.perf_counter()  # this save's own start (its write time excludes the wait)
        use_async = self.async_save and not final and self._fits(copy)
        handles, after = [], None
        for i, (state, path, extra) in enumerate(items):
            # an earlier item (the critic) keeps one more: until the last (the policy) is
            # published, the policy checkpoint --resume would read is the one before, and its
            # critic must still be there
            keep = self.keep_last + 1 if self.keep_last and i < len(items) - 1 \
                else self.keep_last
            after = ff.save_checkpoint(state, path, extra=extra, keep_last=keep,
                                       async_save=use_async, publish_after=after)
            handles += [after] if after is not None else []
        path = Path(items[-1][1])
        if handles:
            self._pending = (path, t1, handles)
            row["checkpoint_copy_bytes"] = copy
        else:
            row.update(checkpoint=str(path), checkpoint_write_seconds=time.perf_counter() - t1)
        published = [p for p in (earlier, row.get("checkpoint") if not handles else None) if p]
        if published:
            row["checkpoints_published"] = published
        row["checkpoint_seconds"] = time.perf_counter() - t0
        return row

    def poll(self) -> dict:
        """The metrics of the save in flight if it has published (this rank's view, which
        is enough: every rank agrees on a save's outcome); a failure waits for ``wait()``."""
        if self._pending is None or not all(h.published for h in self._pending[2]):
            return {}
        return self.wait()

    def wait(self) -> dict:
        """Wait for the save in flight; its metrics. Raises CheckpointError on every rank if
        it failed (nothing published)."""
        if self._pending is None:
            return {}
        path, t0, handles = self._pending
        self._pending = None
        failures = []
        for handle in handles:
            try:
                handle.wait()
            except Exception as exc:  # noqa: BLE001 - every handle waited, the first raised
                failures.append(exc)
        if failures:
            raise failures[0]
        return {"checkpoint": str(path),
                "checkpoint_write_seconds": max(h.finished_at for h in handles) - t0}

    def _fits(self, copy: int) -> bool:
        """Whether this host has room for the ranks' copies (half its available memory, on
        every host: the ranks agree); otherwise the save is synchronous, said once."""
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        available = available_host_memory()
        big = available is not None and copy * ranks > available / 2
        flag = torch.tensor([int(big)], dtype=torch.int64)
        if not bool(all_reduce_sum(flag, op=dist.ReduceOp.MAX).item()):
            return True
        if not self._warned:
            self._warned = True
            log(f"checkpoint.async_save: saving synchronously: the host copy of the state "
                f"({copy * ranks / 2**30:.1f} GiB for {ranks} rank(s) on a host) exceeds half "
                f"of its available memory")
        return False


class Metrics:
    """JSON lines in ``path`` (rank 0 writes), and TensorBoard scalars in ``tensorboard`` (a
    directory) when given. On resume, lines of ``phase`` beyond the resumed step are dropped
    (they belong to steps that will run again)."""

    def __init__(self, path: Path, *, keep_until: dict[str, int] | None = None,
                 tensorboard: Path | None = None, wandb=None):
        self.path = Path(path)
        self.enabled = is_main()
        self.writer = self.wandb = None
        if not self.enabled:
            return
        if wandb is not None:  # a WandbConfig: the run in path's directory
            self.wandb = wandb_run(wandb, self.path.parent, resume=keep_until is not None)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if keep_until is not None and self.path.is_file():
            kept = []
            for line in self.path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except ValueError:
                    continue  # a line cut by a kill
                limit = keep_until.get(row.get("phase"))
                if limit is None or row.get("step", 0) <= limit:
                    kept.append(json.dumps(row))
            self.path.write_text("".join(line + "\n" for line in kept))
        elif keep_until is None and self.path.exists():
            self.path.unlink()
        if tensorboard is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(tensorboard))

    def write(self, row: dict) -> None:
        if not self.enabled:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                 for k, v in row.items()}
        with open(self.path, "a") as fh:
            fh.write(json.dumps(clean) + "\n")
        if self.writer is not None:
            phase, step = row.get("phase", "run"), int(row.get("step", 0))
            for key, value in clean.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) \
                        and key != "step":
                    self.writer.add_scalar(f"{phase}/{key}", value, step)
            self.writer.flush()
        if self.wandb is not None:
            phase = row.get("phase", "run")
            self.wandb.log({f"{phase}/{k}": v for k, v in clean.items()
                            if isinstance(v, (int, float)) and not isinstance(v, bool)})

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def wandb_run(cfg, run_dir: Path, *, resume: bool):
    """A W&B run for ``cfg`` (a WandbConfig) with its files under run_dir/wandb; its id is kept
    in run_dir/wandb/run_id so that --resume continues the same run. Each phase's metrics are
    plotted against that phase's own step (``grpo/step``, ``warmup/step``)."""
    import wandb

    root = Path(run_dir) / "wandb"
    root.mkdir(parents=True, exist_ok=True)
    id_file = root / "run_id"
    run_id = id_file.read_text().strip() if resume and id_file.is_file() else None
    run = wandb.init(project=cfg.project, name=cfg.name or Path(run_dir).resolve().name,
                     mode=cfg.mode, dir=str(run_dir), id=run_id or secrets.token_hex(4),
                     resume="allow", settings=wandb.Settings(silent=True))
    id_file.write_text(run.id)
    for phase in ("warmup", "grpo", "ppo", "sft", "rw", "dpo"):
        run.define_metric(f"{phase}/*", step_metric=f"{phase}/step")
    return run


class Progress:
    """A tqdm progress bar on stderr (rank 0). On a terminal it redraws one line; otherwise it
    prints the bar's line every ``every`` steps and at the end, so logs stay readable."""

    def __init__(self, desc: str, total: int, *, start: int = 0, every: int = 1,
                 enabled: bool = True):
        self.start, self.every, self.total = start, every, total
        # under `fsdpfn run` stderr is the launcher's pipe; it says whether its own is a terminal
        self.tty = sys.stderr.isatty() or os.environ.get("FSDPFN_STDERR_TTY") == "1"
        self.bar = None
        if enabled and is_main():
            from tqdm import tqdm

            # off a terminal tqdm draws into a null stream and update() prints its line
            self.bar = tqdm(total=total, initial=start, desc=desc, dynamic_ncols=True,
                            file=sys.stderr if self.tty else io.StringIO(), ascii=not self.tty,
                            mininterval=0.5, unit="step")

    def update(self, step: int, **fields) -> None:
        if self.bar is None:
            return
        self.bar.set_postfix({k: _fmt(v) for k, v in fields.items() if v is not None},
                             refresh=False)
        self.bar.update(step - self.bar.n)
        if not self.tty and ((step - self.start) % self.every == 0 or step == self.total):
            print(str(self.bar), file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is None:
            return
        self.bar.close()
        self.bar = None


def _fmt(value) -> str:
    if isinstance(value, float):
        if value != 0 and (abs(value) >= 1e4 or abs(value) < 1e-3):
            return f"{value:.2e}"
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.0f}"
    return str(value)


def mean_sequence_prob(state, mesh, batch) -> float:
    """Mean over the rows of a global ``batch`` of exp(Σ logp over loss tokens) (every rank).

    For solved problems (prompt + correct answer + <eos>) this is the expected reward of
    sampling at temperature 1, exactly and without sampling."""
    import fsdpfn as ff
    from fsdpfn import keys as K
    local = ff.forward_logp(state, ff.shard_batch(batch, mesh), out_key=K.LOGP)
    seq = torch.where(local[K.LOSS_MASK], local[K.LOGP], torch.zeros(())).sum(-1)
    totals = torch.tensor([float(seq.exp().sum()), float(seq.numel())], dtype=torch.float64)
    totals = all_reduce_sum(totals, mesh.group("dp") if mesh.dp > 1 else None)
    return float(totals[0] / totals[1])
