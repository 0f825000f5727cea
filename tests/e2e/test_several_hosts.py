"""A recipe on several hosts: ``fsdpfn run FILE --prepare`` checks the config, writes run_dir
(config.yaml, the prepared data) and prints the torchrun command; torchrun starts the trainer
ranks on each host (fsdpfn.app.recipes.worker). Two hosts are two torchrun agents of one
rendezvous here (``--nnodes 2 --nproc-per-node 1``), two ranks in all. Before, ranks started
this way on data files stopped on "'NoneType' object has no attribute 'take'" (the data is
prepared by the launcher, which never ran), and an RL recipe without a server was refused only
after its whole warm-up.

References: the same config run by ``fsdpfn run`` on two ranks of one host (the same seed, the
same rows, the same two-rank layout: the losses must be the same floats), and an uninterrupted
run for --resume."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from fsdpfn.testing import write_tiny_hf_dir
from fsdpfn.wire.ports import free_port

pytestmark = [pytest.mark.dist, pytest.mark.timeout(280)]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """A user's sft config on data files and a model directory of their own."""
    root = tmp_path_factory.mktemp("hosts")
    model = write_tiny_hf_dir(root / "m", texts=["12+34=46", "7+8=15", "0123456789+="] * 20)
    with open(root / "train.jsonl", "w") as fh:
        for a in range(10, 60):
            for b in (10, 11, 12, 13):
                fh.write(json.dumps({"prompt": f"{a}+{b}=", "response": str(a + b)}) + "\n")
    config = root / "job.yaml"
    config.write_text(f"recipe: sft\nsteps: 3\nbatch_size: 16\neval_every: 0\n"
                      f"log: {{plot: false}}\nlaunch: {{nproc: 2}}\nmodel: {{path: {model}}}\n"
                      f"data: {{train_files: [{root / 'train.jsonl'}], max_prompt_tokens: 64, "
                      f"max_response_tokens: 16}}\n")
    return config


def fsdpfn(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "fsdpfn", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=200)


def hosts(config, *extra, n=2, recipe_args=()):
    """``n`` torchrun agents of one rendezvous (each a host of one rank), as --prepare says."""
    port = free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(n), "--nproc-per-node",
         "1", "--node-rank", str(r), "--rdzv-backend", "c10d", "--rdzv-endpoint",
         f"127.0.0.1:{port}", "-m", "fsdpfn.app.recipes.worker", "--config", str(config),
         *recipe_args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(n)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=200)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    return [p.returncode for p in procs], "\n".join(outs)


def losses(run_dir):
    return [json.loads(x)["loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()
            if "loss" in json.loads(x)]


def test_prepare_writes_run_dir_and_the_command_and_starts_nothing(job, tmp_path):
    run_dir = tmp_path / "run"
    proc = fsdpfn("run", job, f"run_dir={run_dir}", "--prepare", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.yaml", "data"]
    assert (run_dir / "data" / "train.jsonl").read_text().count("\n") == 200
    assert "data (train): 200 of 200 samples" in proc.stderr
    line = proc.stdout.strip()
    assert line.startswith(f"cd {tmp_path} && torchrun --nnodes NODES --nproc-per-node 2 "
                           f"--node-rank NODE_RANK --rdzv-backend c10d --rdzv-endpoint "
                           f"HEAD:29500 -m fsdpfn.app.recipes.worker --config "
                           f"{run_dir / 'config.yaml'}"), line


def test_two_hosts_train_as_fsdpfn_run_does_and_resume(job, tmp_path):
    prepared, local, longer = tmp_path / "hosts", tmp_path / "local", tmp_path / "longer"
    assert fsdpfn("run", job, f"run_dir={prepared}", "--prepare").returncode == 0
    codes, out = hosts(prepared / "config.yaml")
    assert codes == [0, 0], out[-3000:]
    proc = fsdpfn("run", job, f"run_dir={local}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(losses(local)) == 3 and losses(prepared) == losses(local)
    # a second start over the checkpoints needs --resume; with it, the run goes on exactly
    codes, out = hosts(prepared / "config.yaml")
    assert codes != [0, 0] and "run_dir: " in out and "holds a previous run's checkpoints; " \
        "pass --resume to continue it" in out, out[-3000:]
    proc = fsdpfn("run", job, f"run_dir={prepared}", "steps=5", "--prepare", "--resume")
    assert proc.returncode == 0 and proc.stdout.rstrip().endswith("--resume"), proc.stderr
    codes, out = hosts(prepared / "config.yaml", recipe_args=["--resume"])
    assert codes == [0, 0] and "resumed from" in out, out[-3000:]
    assert fsdpfn("run", job, f"run_dir={longer}", "steps=5").returncode == 0
    assert len(losses(longer)) == 5 and losses(prepared) == losses(longer)


def test_ranks_started_without_prepare_say_so_in_one_line(job, tmp_path):
    config = tmp_path / "job.yaml"
    config.write_text(job.read_text() + f"run_dir: {tmp_path / 'run'}\n")
    codes, out = hosts(config, n=1)
    assert codes == [1], out[-3000:]
    assert "ConfigError: data.train_files: must be prepared into " in out
    assert "run `fsdpfn run FILE --prepare` first" in out
    assert "NoneType" not in out


def test_prepare_refusals(job, tmp_path):
    run_dir = tmp_path / "run"
    proc = fsdpfn("run", job, f"run_dir={run_dir}", "--prepare", "--dry-run")
    assert proc.returncode == 2 and "--prepare: must not be given with --dry-run" in proc.stderr
    proc = fsdpfn("run", "grpo", f"run_dir={run_dir}", "--prepare")
    assert proc.returncode == 2 and proc.stderr.startswith(
        "fsdpfn: error: rollout.url: must name running rollout servers with --prepare"), \
        proc.stderr
    assert not run_dir.exists()


def test_grpo_on_two_hosts_pushes_to_a_running_server(job, tmp_path):
    from fsdpfn.rollout import launch_server

    model = job.parent / "m"
    with open(tmp_path / "rl.jsonl", "w") as fh:
        for a in range(10, 40):
            fh.write(json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a)}) + "\n")
    server = launch_server(model, log_dir=tmp_path / "logs", health_timeout=120)
    try:
        config = tmp_path / "grpo.yaml"
        config.write_text(f"recipe: grpo\nrun_dir: {tmp_path / 'run'}\nsteps: 2\n"
                          f"prompts_per_step: 4\nwarmup: {{steps: 0}}\nlog: {{plot: false}}\n"
                          f"model: {{path: {model}}}\nrollout: {{url: '{server.url}'}}\n"
                          f"data: {{train_files: [{tmp_path / 'rl.jsonl'}], "
                          f"max_prompt_tokens: 32, max_response_tokens: 8}}\n")
        proc = fsdpfn("run", config, "--prepare")
        assert proc.returncode == 0, proc.stderr
        codes, out = hosts(tmp_path / "run" / "config.yaml")
        assert codes == [0, 0], out[-3000:]
        import urllib.request

        with urllib.request.urlopen(server.url + "/weight_version", timeout=10) as r:
            served = json.loads(r.read())
    finally:
        server.close()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["phase"] == "grpo"] == [1, 2]
    assert "pushed weights version 0" in out and served["weight_version"] == 2, served


def test_an_rl_rank_without_a_server_is_refused_before_its_warm_up(tmp_path):
    config = tmp_path / "grpo.yaml"
    config.write_text(f"recipe: grpo\nrun_dir: {tmp_path / 'run'}\nsteps: 1\n")
    codes, out = hosts(config, n=1)
    assert codes == [1], out[-3000:]
    assert "rollout.url: the RL recipes need a rollout server" in out
    assert "warm-up" not in out and not (tmp_path / "run" / "metrics.jsonl").exists()
