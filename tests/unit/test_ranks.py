"""The launcher's trainer ranks (fsdpfn.app.ranks): torchrun's environment for each rank, one
pipe for their output, and a failed rank stops the others, SIGKILL after the grace period for a
rank that ignores SIGTERM. Real processes, small Python scripts standing in for the worker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from fsdpfn.app.ranks import TrainerRanks, describe_status

# one write per rank (a pipe keeps a write of under 4 KiB whole)
ENV_SCRIPT = ("import json, os; os.write(1, (json.dumps({k: os.environ[k] for k in ('RANK',"
              " 'LOCAL_RANK', 'WORLD_SIZE', 'LOCAL_WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT',"
              " 'EXTRA')}) + '\\n').encode())")


def _read_all(ranks: TrainerRanks) -> bytes:
    out = b""
    while chunk := os.read(ranks.stdout.fileno(), 65536):
        out += chunk
    return out


@pytest.mark.timeout(60)
def test_each_rank_gets_torchruns_environment_and_one_pipe_carries_their_output():
    ranks = TrainerRanks([sys.executable, "-c", ENV_SCRIPT], 3, port=4321,
                         env={**os.environ, "EXTRA": "x"})
    out = _read_all(ranks)
    assert ranks.wait(timeout=30) == 0 and ranks.failed is None and not ranks.stopped
    assert ranks.describe_failure() is None and not ranks.running()
    seen = sorted((json.loads(line) for line in out.decode().splitlines()),
                  key=lambda e: int(e["RANK"]))
    assert seen == [{"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "3",
                     "LOCAL_WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "4321",
                     "EXTRA": "x"} for r in range(3)]


@pytest.mark.timeout(60)
def test_a_failed_rank_stops_the_others_and_its_status_is_the_groups():
    """Rank 1 exits 3 while rank 0 would sleep for a minute: rank 0 is stopped by SIGTERM and
    the group's status is rank 1's."""
    code = "import os, sys, time\nif os.environ['RANK'] == '1': sys.exit(3)\ntime.sleep(60)\n"
    t0 = time.monotonic()
    ranks = TrainerRanks([sys.executable, "-c", code], 2, port=1, env=dict(os.environ))
    assert ranks.wait(timeout=30) == 3
    assert time.monotonic() - t0 < 20
    assert ranks.failed == (1, 3) and ranks.procs[0].returncode == -signal.SIGTERM
    assert ranks.stopped
    assert ranks.describe_failure() == "trainer rank 1 exited with status 3"


@pytest.mark.timeout(60)
def test_a_rank_that_ignores_sigterm_is_killed_after_the_grace_period(tmp_path):
    """Rank 1 ignores SIGTERM (and says so in a file); rank 0 then dies by SIGKILL."""
    ready = tmp_path / "ready"
    code = ("import os, pathlib, signal, time\nready = pathlib.Path(os.environ['READY'])\n"
            "if os.environ['RANK'] == '1':\n"
            "    signal.signal(signal.SIGTERM, signal.SIG_IGN); ready.write_text('1')\n"
            "else:\n"
            "    while not ready.exists(): time.sleep(0.05)\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\n"
            "time.sleep(60)\n")
    ranks = TrainerRanks([sys.executable, "-c", code], 2, port=1,
                         env={**os.environ, "READY": str(ready)}, grace=1.0)
    t0 = time.monotonic()
    assert ranks.wait(timeout=30) == 128 + signal.SIGKILL
    assert time.monotonic() - t0 < 15
    assert ranks.failed == (0, -signal.SIGKILL)
    assert ranks.procs[1].returncode == -signal.SIGKILL  # SIGTERM ignored, then killed
    assert ranks.describe_failure() == "trainer rank 0 was killed by SIGKILL"


@pytest.mark.timeout(60)
def test_stop_ends_ranks_that_are_still_starting_and_wait_times_out_while_they_run():
    ranks = TrainerRanks([sys.executable, "-c", "import time; time.sleep(60)"], 2, port=1,
                         env=dict(os.environ))
    with pytest.raises(subprocess.TimeoutExpired):
        ranks.wait(timeout=0.2)
    assert ranks.running()
    ranks.stop()
    assert ranks.wait(timeout=30) == 128 + signal.SIGTERM
    assert not ranks.running()


def test_describe_status():
    assert describe_status(0) == "exited with status 0"
    assert describe_status(-9) == "was killed by SIGKILL"
    assert describe_status(-200) == "was killed by signal 200"

