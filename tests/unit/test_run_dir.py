"""The run_dir rules of ``fsdpfn run``: a previous run needs --resume or --overwrite, and
--resume in a run_dir without one says so and starts at step 0 (a job script may always pass
it)."""

from __future__ import annotations

import pytest

from fsdpfn.app import launcher
from fsdpfn.errors import ConfigError


def test_resume_without_a_previous_run_says_it_starts_at_step_0(tmp_path, capsys):
    launcher._prepare_run_dir(tmp_path / "fresh", resume=True, overwrite=False)
    err = capsys.readouterr().err
    assert "--resume: no previous run to continue; starting at step 0" in err, err
    assert (tmp_path / "fresh").is_dir()


def test_a_previous_run_needs_resume_or_overwrite_and_resume_keeps_it(tmp_path, capsys):
    run_dir = tmp_path / "r"
    (run_dir / "checkpoints").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"holds a previous run \(checkpoints\).*--resume"):
        launcher._prepare_run_dir(run_dir, resume=False, overwrite=False)
    launcher._prepare_run_dir(run_dir, resume=True, overwrite=False)
    assert "no previous run" not in capsys.readouterr().err
    assert (run_dir / "checkpoints").is_dir()
