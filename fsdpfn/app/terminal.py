"""What passes between the terminal and the trainer ranks of ``fsdpfn run``, the launcher's side
of run_dir/.ranks/ and run_dir/trainer.log: the launcher's own lines (``say``), Ctrl-C forwarded
to the ranks (``Signals``, by the pids they write to run_dir/.ranks/), their output copied to
trainer.log and the terminal (``Relay``), and a failed rank's report
(run_dir/.ranks/error_rank*.json, fsdpfn.app.recipes.worker.report_error) turned into the one
line the terminal shows (``report_failure``).

Only the standard library is imported here (the launcher's module-level imports stay free of
torch: fsdpfn.app.launcher).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

__all__ = ["TRAINER_LOG", "Relay", "Signals", "log_line", "rank_error", "report_failure", "say"]

TRAINER_LOG = "trainer.log"  # under run_dir: everything the trainer ranks printed


def say(message: str) -> None:
    """One line of the launcher's own on the terminal (stderr), marked [fsdpfn]."""
    print(f"[fsdpfn] {message}", file=sys.stderr, flush=True)


class Signals:
    """SIGINT/SIGTERM in the launcher. The first is forwarded to the trainer ranks (their pids
    are in run_dir/.ranks/ once their stop handler is in place): they finish the current step,
    save it and exit. Ranks that are not running yet get SIGTERM, which ends them at once.
    The second kills every rank."""

    def __init__(self, run_dir: Path):
        self.count = 0
        self.trainer = None  # fsdpfn.app.ranks.TrainerRanks, once started
        self.ranks_dir = run_dir / ".ranks"
        self._previous = {}

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handler)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def rank_pids(self) -> list[int]:
        pids = []
        for path in sorted(self.ranks_dir.glob("rank*.pid")):
            try:
                pids.append(int(path.read_text()))
            except (OSError, ValueError):
                pass
        return pids

    def _kill(self, pid: int, sig: int) -> None:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def _handler(self, signum, frame) -> None:
        self.count += 1
        ranks = self.trainer
        running = ranks is not None and ranks.running()
        pids = self.rank_pids() if running else []
        if self.count == 1:
            print(file=sys.stderr)
            say(f"{signal.Signals(signum).name}: stopping after the current step "
                f"(again to abort now)")
            for pid in pids:
                self._kill(pid, signal.SIGINT)
            if running and not pids:
                ranks.signal(signal.SIGTERM)
        else:
            say("aborting: killing the trainer ranks (the last published checkpoint is intact)")
            for pid in pids:
                self._kill(pid, signal.SIGKILL)
            if running:
                ranks.kill()


class Relay:
    """The trainer ranks' output (one pipe) copied to run_dir/trainer.log and to the terminal
    as it comes (progress bars redraw), until a rank reports a failure
    (run_dir/.ranks/error_rank*.json): what follows, the rank's traceback and the launcher's
    line on which rank failed, goes to the log only, and the launcher prints the one-line
    error."""

    def __init__(self, pipe, run_dir: Path):
        import threading

        self.pipe, self.ranks_dir = pipe, run_dir / ".ranks"
        self.log_path = run_dir / TRAINER_LOG
        self.thread = threading.Thread(target=self._copy, daemon=True)
        self.thread.start()

    def _copy(self) -> None:
        fd = self.pipe.fileno()
        quiet = False
        with open(self.log_path, "ab") as log:
            while chunk := os.read(fd, 65536):
                log.write(chunk)
                log.flush()
                quiet = quiet or any(self.ranks_dir.glob("error_rank*.json"))
                if not quiet:
                    sys.stderr.buffer.write(chunk)
                    sys.stderr.flush()

    def join(self) -> None:
        self.thread.join(timeout=30)


def rank_error(run_dir: Path) -> dict | None:
    """The first failure a trainer rank reported (fsdpfn.app.recipes.worker.report_error)."""
    records = []
    for path in (run_dir / ".ranks").glob("error_rank*.json"):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            pass
    return min(records, key=lambda r: (r.get("time", 0), r.get("rank", 0))) if records else None


def report_failure(run_dir: Path, rc: int, failed: str | None = None) -> str:
    """The one line a failed trainer leaves on the terminal: the first rank's error, typed,
    else how the first failed rank ended (``failed``: "trainer rank 1 was killed by
    SIGKILL"), and where the trace is (run_dir/trainer.log)."""
    error = rank_error(run_dir)
    what = f"{error['type']}: {error['message']}" if error else \
        (failed or f"the trainer exited with status {rc}")
    print(f"fsdpfn: error: {what} (trace in {run_dir / TRAINER_LOG})", file=sys.stderr,
          flush=True)
    return what[:2000]


def log_line(run_dir: Path, line: str) -> None:
    """A line of the launcher's own in run_dir/trainer.log (not on the terminal)."""
    with open(run_dir / TRAINER_LOG, "a") as log:
        log.write(line + "\n")
