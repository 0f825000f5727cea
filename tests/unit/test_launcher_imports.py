"""What ``fsdpfn run`` imports in its own process on a CPU host: for the embedded model, neither
torch nor transformers, before the ranks start or after they end. Each costs seconds of every
launch, and the ranks and servers import them anyway (BENCHMARKS.md, "Start-up of fsdpfn run")."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fsdpfn.app.recipes.placement import _cuda_device_files

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import sys
from pathlib import Path

from fsdpfn.app import launcher
from fsdpfn.app.cli import _resolve
from fsdpfn.app.recipes.placement import place
from fsdpfn.app.run_dir import prepare_run_dir
from fsdpfn.app.servers import start_servers

for recipe in ("sft", "dpo", "rw", "grpo", "ppo"):
    run_dir = Path(sys.argv[1]) / recipe
    cfg = _resolve(f"examples/{recipe}.yaml", [f"run_dir={run_dir}"])
    assert launcher.launch(cfg, dry_run=True) == 0  # the config, placement and preflight
    prepare_run_dir(run_dir, resume=False, overwrite=False)
    launcher._prepare_data(cfg, run_dir, resume=False)
    if recipe in ("grpo", "ppo"):  # a real server starts (and is stopped at once)
        for server in start_servers(cfg, run_dir, run_dir / "model0",
                                    place(cfg, 0, needs_rollout=True)):
            server.close()
    (run_dir / "checkpoints").mkdir()
    launcher._summarize(cfg, run_dir, 1.0, 0, False)  # the checkpoint lookup and summary
print("IMPORTED", sorted(m for m in ("torch", "transformers") if m in sys.modules))
"""


@pytest.mark.skipif(_cuda_device_files(), reason="a GPU host counts its devices through torch")
@pytest.mark.timeout(120)
def test_the_launcher_of_an_embedded_cpu_run_imports_neither_torch_nor_transformers(tmp_path):
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "IMPORTED []"
