"""What every recipe's ranks share: the run context, a clean stop on SIGINT, metrics as JSON
lines, a progress bar on stderr, and checkpoint bookkeeping.

A stop is cooperative: SIGINT/SIGTERM only set a flag; at the end of each step all ranks agree
(one all-reduce) whether any rank was asked to stop, then stop together after the step, so a
checkpoint is never cut short (and checkpoints are atomic anyway).
"""

from __future__ import annotations

import json
import math
import signal
import sys
import time
from pathlib import Path

import attrs
import torch
import torch.distributed as dist

__all__ = ["RunContext", "StopFlag", "Metrics", "Progress", "log", "is_main",
           "broadcast_from_main", "mean_sequence_prob"]


def is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


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
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


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
    stop: StopFlag = attrs.field(factory=StopFlag)


class Metrics:
    """JSON lines in ``path`` (rank 0 writes). On resume, lines of ``phase`` beyond the resumed
    step are dropped (they belong to steps that will run again)."""

    def __init__(self, path: Path, *, keep_until: dict[str, int] | None = None):
        self.path = Path(path)
        self.enabled = is_main()
        if not self.enabled:
            return
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

    def write(self, row: dict) -> None:
        if not self.enabled:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                 for k, v in row.items()}
        with open(self.path, "a") as fh:
            fh.write(json.dumps(clean) + "\n")


def _fmt_time(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 60}:{seconds % 60:02d}"


class Progress:
    """A progress bar on stderr (rank 0): ``grpo 12/40 [#####....] 30% reward 0.41 ... 0:31<1:12``.

    On a terminal it redraws one line; otherwise it prints a line every ``every`` steps and at
    the end, so logs stay readable.
    """

    def __init__(self, desc: str, total: int, *, start: int = 0, every: int = 1,
                 enabled: bool = True, width: int = 24):
        self.desc, self.total, self.start, self.every, self.width = desc, total, start, every, width
        self.enabled = enabled and is_main()
        self.tty = sys.stderr.isatty()
        self.t0 = time.monotonic()
        self.done = start
        self.fields: dict[str, str] = {}

    def update(self, step: int, **fields) -> None:
        if not self.enabled:
            return
        self.done = step
        self.fields = {k: _fmt(v) for k, v in fields.items() if v is not None}
        if self.tty:
            sys.stderr.write("\r" + self._line() + "\x1b[K")
            sys.stderr.flush()
        elif (step - self.start) % self.every == 0 or step == self.total:
            print(self._line(), file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\n")
            sys.stderr.flush()

    def _line(self) -> str:
        frac = self.done / max(self.total, 1)
        filled = int(round(frac * self.width))
        elapsed = time.monotonic() - self.t0
        ran = self.done - self.start
        eta = elapsed / ran * (self.total - self.done) if ran else 0.0
        bar = "#" * filled + "." * (self.width - filled)
        stats = " ".join(f"{k} {v}" for k, v in self.fields.items())
        return (f"{self.desc} {self.done:>{len(str(self.total))}}/{self.total} [{bar}] "
                f"{frac:4.0%} {stats} {_fmt_time(elapsed)}<{_fmt_time(eta)}")


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
    if mesh.dp > 1:
        dist.all_reduce(totals, group=mesh.group("dp"))
    return float(totals[0] / totals[1])
