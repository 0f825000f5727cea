"""GRPO with two rollout servers end to end through the CLI (CPU, gloo): the groups of every step
spread over both, every push reaching both through one update group, the servers' log-probs
equal to the trainer's.

Two runs of the embedded demo, shortened (10 warm-up steps, 3 GRPO steps of 8 prompts x 8
answers): two external servers (``rollout.url`` as a list, started here so that they outlive
the run and can be asked afterwards) with the synchronous loop, and two servers of the launcher's
own (``rollout.servers: 2``) with generation one step ahead (``rollout.max_staleness: 1``).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cli_runs import fsdpfn, grpo_rows, port_open  # tests/cli_runs.py

pytestmark = pytest.mark.dist

SHORT = ["steps=3", "warmup.steps=10", "warmup.target_reward=null", "prompts_per_step=8",
         "checkpoint.every=0", "log.every=1", "log.plot=false"]


def check_both_servers_worked(rows: list[dict]) -> None:
    """Every step's 64 answers came from both servers, whole groups of 8 each."""
    for r in rows:
        assert r["rollout_servers"] == 2, r
        counts = (r["rollout_rows_server0"], r["rollout_rows_server1"])
        assert sum(counts) == 64 and min(counts) > 0 and all(c % 8 == 0 for c in counts), r
        assert min(r["rollout_tokens_server0"], r["rollout_tokens_server1"]) > 0, r
        assert 1.0 <= r["rollout_load_imbalance"] <= 2.0


def trainer_logp(run_dir: Path, rows: list[list[int]]) -> list[list[float]]:
    """Teacher-forced log-probs of ``rows`` under the run's final checkpoint, in float64 (the
    warm-up's HF model with the checkpoint's weights)."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoModelForCausalLM

    final = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    dcp_to_torch_save(final, run_dir / "final.pt")
    saved = torch.load(run_dir / "final.pt", weights_only=False)["model"]
    model = AutoModelForCausalLM.from_pretrained(run_dir / "sft", dtype=torch.float64)
    missing, unexpected = model.load_state_dict(
        {k.removeprefix("lm."): v.double() for k, v in saved.items()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    out = []
    with torch.no_grad():
        for ids in rows:
            logits = model(input_ids=torch.tensor([ids])).logits[0]
            logp = torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(ids[1:])[:, None])
            out.append([0.0] + logp[:, 0].tolist())
    return out


@pytest.mark.timeout(180)
def test_a_server_told_to_wait_serves_the_model_once_written_and_gives_up_after_the_wait(
        tmp_path):
    """--wait-for-model (the servers of `fsdpfn run`, whose model0 trainer rank 0 writes as it
    starts): the server waits for the directory's config.json and then serves that model; one
    that never appears ends the server after the wait, naming the directory and the option."""
    import threading

    from fsdpfn.app.recipes import demo_config
    from fsdpfn.app.recipes.model import load_tokenizer, write_initial_model
    from fsdpfn.rollout import launch_server
    from fsdpfn.rollout.process import free_port
    from fsdpfn.wire.http import call

    model, model_dir, port = demo_config([]).model, tmp_path / "model0", free_port()
    log = tmp_path / f"rollout-{port}.log"

    def write_once_waiting():  # the model appears only after the server said it waits
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if log.is_file() and "waiting up to 60 s for" in log.read_text():
                write_initial_model(model, model_dir, load_tokenizer(model))
                return
            time.sleep(0.05)

    writer = threading.Thread(target=write_once_waiting)
    writer.start()
    try:
        server = launch_server(model_dir, port=port, log_dir=tmp_path,
                               extra_args=("--wait-for-model", "60"))
    finally:
        writer.join()
    try:
        info = call(server.url, "/get_model_info", timeout=30)
        assert info["model_path"] == str(model_dir)
        assert (model_dir / "config.json").is_file()
    finally:
        server.close()
    missing = tmp_path / "never"
    done = subprocess.run([sys.executable, "-m", "fsdpfn.rollout", "--model", str(missing),
                           "--port", str(free_port()), "--device", "cpu",
                           "--wait-for-model", "0.5"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        f"fsdpfn.rollout: --model {missing}: no config.json after 0.5 s (--wait-for-model)")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["missing", "empty"])
def test_a_server_on_no_model_directory_ends_with_one_line_naming_it(tmp_path, where):
    """A typo in --model was read by transformers as a Hub id: the start ended in a download's
    traceback. It is one line naming the flag, the path and what is missing."""
    from fsdpfn.rollout.__main__ import main
    from fsdpfn.rollout.process import free_port

    path = tmp_path / where
    if where == "empty":
        path.mkdir()
    with pytest.raises(SystemExit) as exc:
        main(["--model", str(path), "--port", str(free_port()), "--device", "cpu"])
    why = "there is no directory there" if where == "missing" else "it has no config.json"
    assert str(exc.value) == (f"fsdpfn.rollout: --model {path}: must be a model directory "
                              f"(save_pretrained's layout), and {why}")


@pytest.mark.timeout(300)
def test_two_external_servers_share_the_steps_and_serve_the_last_push_exactly(tmp_path):
    from fsdpfn.app.recipes import demo_config
    from fsdpfn.app.recipes.model import load_tokenizer, write_initial_model
    from fsdpfn.rollout import launch_server

    run_dir = tmp_path / "ext"
    model = demo_config([]).model
    write_initial_model(model, run_dir / "model0", load_tokenizer(model))
    servers = [launch_server(run_dir / "model0", device="cpu", threads=1, log_dir=tmp_path)
               for _ in range(2)]
    try:
        urls = [s.url for s in servers]
        done = fsdpfn("demo", f"run_dir={run_dir}", f"rollout.url=[{urls[0]}, {urls[1]}]",
                      "eval.every=2", "eval.n_prompts=16", *SHORT)
        assert done.returncode == 0, done.stderr[-4000:]
        assert f"2 rollout servers {urls[0]} {urls[1]}" in done.stderr
        rows = grpo_rows(run_dir)
        assert [r["step"] for r in rows] == [1, 2, 3]
        check_both_servers_worked(rows)
        # each step sampled from the weights pushed after the one before, on both servers, and
        # the trainer's log-probs of those samples equal the servers' (behav_logp)
        versions = [r["version"] for r in rows]
        assert [r["served_version"] for r in rows[1:]] == versions[:-1], rows
        assert all(r["behav_gap"] < 1e-4 for r in rows), [r["behav_gap"] for r in rows]
        assert all(0.0 <= r["greedy_accuracy"] <= 1.0 for r in rows if "greedy_accuracy" in r)
        summary = json.loads((run_dir / "summary.json").read_text())
        assert [(s["url"], s["weight_version"]) for s in summary["rollout_servers"]] == \
            [(u, versions[-1]) for u in urls]
        # after the last push: both serve it, and exactly the trainer's final weights
        for s in servers:
            assert s.get("/get_model_info")["version"] == versions[-1]
        probe = [[3, 5, 7, 9, 11, 13, 2, 4], [1, 6, 8, 10, 12]]
        want = trainer_logp(run_dir, probe)
        for s in servers:
            got = s.post("/forward", {"input_ids": probe})
            assert got["weight_version"] == versions[-1]
            gap = max(abs(a - b) for g, w in zip(got["token_logprobs"], want)
                      for a, b in zip(g, w))
            assert gap < 1e-4, (s.url, gap)
    finally:
        for s in servers:
            s.close()


@pytest.mark.timeout(300)
def test_two_servers_of_the_launcher_ahead_of_training_reach_the_final_version(tmp_path):
    run_dir = tmp_path / "own"
    done = fsdpfn("demo", f"run_dir={run_dir}", "rollout.servers=2", "rollout.max_staleness=1",
                  "eval.every=0", *SHORT)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = grpo_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    check_both_servers_worked(rows)
    assert all(r["staleness_max"] <= 1 for r in rows), [r["staleness_max"] for r in rows]
    assert all(math.isfinite(r["behav_gap"]) for r in rows)
    summary = json.loads((run_dir / "summary.json").read_text())
    servers = summary["rollout_servers"]
    assert len(servers) == 2 and len({s["url"] for s in servers}) == 2
    assert [s["weight_version"] for s in servers] == [rows[-1]["version"]] * 2, servers
    assert [Path(s["log"]).name for s in servers] == ["rollout.log", "rollout1.log"]
    assert all(s["device"] == "cpu" for s in servers)
    assert "2 rollout servers" in done.stderr and "CPU, 2 servers" in done.stderr
    assert not any(port_open(s["url"]) for s in servers), "a rollout server is still running"


@pytest.mark.timeout(180)
def test_a_server_on_an_inherited_socket_holds_its_port_while_it_waits_for_the_model(tmp_path):
    """--fd (the servers of `fsdpfn run`): the launcher binds the port and hands the listening
    socket to the server, so that no other process of the host can take the port while the
    server waits for the starting model; a /health poll sent meanwhile is answered once the
    model is served."""
    import errno
    import socket
    import threading

    from fsdpfn.app.recipes import demo_config
    from fsdpfn.app.recipes.model import load_tokenizer, write_initial_model

    model, model_dir = demo_config([]).model, tmp_path / "model0"
    listening = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listening.bind(("127.0.0.1", 0))
    listening.listen(16)
    port = listening.getsockname()[1]
    log = tmp_path / "rollout.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fsdpfn.rollout", "--model", str(model_dir), "--port",
             str(port), "--device", "cpu", "--wait-for-model", "90", "--fd",
             str(listening.fileno())], stdout=out, stderr=subprocess.STDOUT,
            pass_fds=(listening.fileno(),))
    listening.close()
    answers: list = []
    try:
        deadline = time.monotonic() + 120
        while "waiting up to 90 s for" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        other = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        with pytest.raises(OSError) as taken:  # the port is held while the server waits
            other.bind(("127.0.0.1", port))
        other.close()
        assert taken.value.errno == errno.EADDRINUSE

        def poll():  # sent before the model exists: it waits in the socket's backlog
            import urllib.request
            opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
            with opener.open(f"http://127.0.0.1:{port}/health", timeout=120) as r:
                answers.append(r.status)

        poller = threading.Thread(target=poll)
        poller.start()
        write_initial_model(model, model_dir, load_tokenizer(model))
        poller.join(timeout=150)
        assert answers == [200], (answers, log.read_text()[-2000:])
    finally:
        proc.terminate()
        proc.wait(timeout=30)
