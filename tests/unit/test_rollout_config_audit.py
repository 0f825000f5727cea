"""Rollout settings that cannot apply are refused, never ignored, and waits and failures around
the servers say what they are (the several-servers audit):

- ``rollout.gpus`` where no server of fsdpfn run's is placed on CUDA (rollout.device cpu,
  rollout.url, a host without GPUs) and ``transport: ipc`` with external servers: one line
  naming the key, the rule and the value, before launch;
- external servers that do not answer: one line says what is awaited and for how long, the
  failure names the URLs (external servers write no run_dir/rollout.log), one deadline for all;
- ``--resume`` is suggested only where there is something to continue;
- one server named under two URLs is refused before a push starts (it would hang the group).
"""

from __future__ import annotations

import json
import socket
import time

import pytest

import fsdpfn as ff
from fsdpfn.app import cli
from fsdpfn.app import launcher as L
from fsdpfn.app.servers import check_server_gpus
from fsdpfn.app.recipes import default_config
from fsdpfn.app.recipes import placement as P
from fsdpfn.app.recipes.rl import wait_for_servers
from fsdpfn.errors import ConfigError, WeightSyncError

TWO = "rollout.url=[http://127.0.0.1:1, http://127.0.0.1:2]"


# ---------------------------------------------------------------- rollout.gpus, transport


@pytest.mark.parametrize("overrides,message", [
    (["rollout.gpus=[0, 1]", "rollout.device=cpu"],
     r"^rollout.gpus: must be null with rollout.device 'cpu' \(GPU indices place servers on "
     r"CUDA; rollout.servers=N starts N on the CPU\), got \[0, 1\]$"),
    (["rollout.servers=2", "rollout.gpus=[0, 1]", "rollout.device=cpu"],
     r"^rollout.gpus: must be null with rollout.device 'cpu' .*, got \[0, 1\]$"),
    ([TWO, "rollout.gpus=[0, 1]"],
     r"^rollout.gpus: must be null when rollout.url names external servers \(fsdpfn run starts "
     r"no server to place\), got \[0, 1\]$"),
    ([TWO, "rollout.transport=ipc"],
     r"^rollout.transport: must not be 'ipc' when rollout.url names external servers \(ipc "
     r"hands CUDA memory of trainer rank 0's GPU to a server fsdpfn run starts on that GPU\); "
     r"use auto, broadcast or disk, got 'ipc'$"),
])
def test_gpus_and_ipc_that_cannot_apply_are_refused_by_the_config(overrides, message):
    with pytest.raises(ConfigError, match=message):
        default_config("grpo", overrides)


@pytest.mark.parametrize("n_gpus,overrides,why", [
    (0, ["rollout.gpus=[0, 1]"], "this host has no GPU"),
    (0, ["rollout.gpus=[0]", "launch.device=cpu"], "this host has no GPU"),
    (4, ["rollout.gpus=[2, 3]", "launch.device=cpu"],
     "rollout.device 'auto' follows launch.device 'cpu'"),
])
def test_gpus_for_servers_that_run_on_the_cpu_are_refused_at_launch(n_gpus, overrides, why):
    cfg = default_config("grpo", overrides)
    placement = P.place(cfg, n_gpus, needs_rollout=True)
    assert placement.server_device == "cpu"  # what the launch did with them before: ignored
    with pytest.raises(ConfigError) as info:
        check_server_gpus(cfg, placement, n_gpus)
    gpus = str(list(cfg.rollout.gpus))
    assert str(info.value) == (f"rollout.gpus: GPU indices need the rollout servers on CUDA, "
                               f"and they would run on the CPU ({why}; rollout.servers=N "
                               f"starts N there), got {gpus}")


@pytest.mark.parametrize("n_gpus,overrides,why", [
    (0, [], "this host has no GPU"),
    (4, ["launch.device=cpu"], "rollout.device 'auto' follows launch.device 'cpu'"),
])
def test_a_float8_cache_for_servers_that_run_on_the_cpu_is_refused_at_launch(n_gpus, overrides,
                                                                              why):
    """--kv-cache-dtype fp8_e4m3 in rollout.server_args where the servers run on the CPU: one
    line at launch naming the key, the rule and the value, instead of each server refusing it
    as it starts; on CUDA servers it passes."""
    args = ["rollout.server_args=[--kv-cache-dtype, fp8_e4m3]"]
    cfg = default_config("grpo", overrides + args)
    placement = P.place(cfg, n_gpus, needs_rollout=True)
    with pytest.raises(ConfigError) as info:
        check_server_gpus(cfg, placement, n_gpus)
    assert str(info.value) == (
        f"rollout.server_args: --kv-cache-dtype fp8_e4m3 is the decode loop's float8 cache, "
        f"read on a GPU of compute capability 8.9 or later, and the servers would run on the "
        f"CPU ({why}); leave the flag out there, got ['--kv-cache-dtype', 'fp8_e4m3']")
    check_server_gpus(default_config("grpo", overrides), placement, n_gpus)  # no flag: no refusal
    cuda = default_config("grpo", args)
    on_cuda = P.place(cuda, 4, needs_rollout=True)
    assert on_cuda.server_device == "cuda"
    check_server_gpus(cuda, on_cuda, 4)  # nothing to refuse


def test_gpus_on_cuda_servers_still_place_them():
    cfg = default_config("grpo", ["rollout.gpus=[2, 3]"])
    placement = P.place(cfg, 4, needs_rollout=True)
    check_server_gpus(cfg, placement, 4)  # nothing to refuse
    assert placement.server_gpus == (2, 3)


def test_fsdpfn_run_refuses_gpus_on_a_host_without_gpus_in_one_line(tmp_path, monkeypatch,
                                                                     capsys):
    monkeypatch.setattr(P, "count_gpus", lambda: 0)
    rc = cli.main(["run", "grpo", f"run_dir={tmp_path / 'run'}", "rollout.gpus=[0,1]",
                   "--dry-run"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err == ("fsdpfn: error: rollout.gpus: GPU indices need the rollout servers on CUDA, "
                   "and they would run on the CPU (this host has no GPU; rollout.servers=N "
                   "starts N there), got [0, 1]\n")
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- waiting for the servers


def _closed_ports(n: int) -> list[int]:
    """Ports nothing listens on (bound, then released)."""
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def test_external_servers_that_do_not_answer_are_named_after_one_announced_wait(capsys):
    urls = [f"http://127.0.0.1:{p}" for p in _closed_ports(3)]
    t0 = time.monotonic()
    with pytest.raises(WeightSyncError) as info:
        wait_for_servers(urls, 1.0, external=True)
    took = time.monotonic() - t0
    assert took < 2.5  # one deadline for every server, not one each (3 s or more)
    err = capsys.readouterr().err
    assert err == (f"[fsdpfn] waiting up to 1 s (rollout.health_timeout_s) for the external "
                   f"rollout server(s) {', '.join(urls)} to answer on /health\n")
    message = str(info.value)
    assert message == (f"rollout.url: every external server must answer /health within "
                       f"rollout.health_timeout_s = 1 s (fsdpfn run starts none; they must be "
                       f"up), got no answer from {', '.join(repr(u) for u in urls)}")
    assert "rollout.log" not in message


def test_a_server_of_fsdpfn_run_that_does_not_answer_points_to_its_own_log(capsys):
    urls = [f"http://127.0.0.1:{p}" for p in _closed_ports(2)]
    with pytest.raises(WeightSyncError, match=rf"^rollout server {urls[0]}: no answer on "
                                              rf"/health within 0.5 s \(rollout.health_timeout_s"
                                              rf"\); see run_dir/rollout.log$"):
        wait_for_servers(urls, 0.5)
    with pytest.raises(WeightSyncError, match=r"see run_dir/rollout1.log$"):
        wait_for_servers([_answering_url(), urls[1]], 0.5)
    assert capsys.readouterr().err == ""  # the launcher announced its own servers


def _answering_url() -> str:
    """A /health that answers 200 (a stand-in for a server that is up)."""
    import http.server
    import threading

    class Health(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            body = json.dumps({"status": "ok"}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}"


# ---------------------------------------------------------------- --resume, only when useful


def _summary_lines(tmp_path, capsys, rc: int, interrupted: bool = False) -> str:
    cfg = default_config("grpo", [f"run_dir={tmp_path}", "log.plot=false"])
    L._summarize(cfg, tmp_path, 3.0, rc, interrupted)
    return capsys.readouterr().err


def test_resume_is_not_suggested_when_nothing_was_saved(tmp_path, capsys):
    for rc, interrupted in ((1, False), (130, True)):
        err = _summary_lines(tmp_path, capsys, rc, interrupted)
        assert "0 steps" in err and "--resume" not in err
        assert "metrics" not in err  # a run failing before its first row names no such file


def test_the_summary_names_the_metrics_file_once_written(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text(json.dumps(
        {"phase": "grpo", "step": 1, "reward_mean": 0.25}) + "\n")
    err = _summary_lines(tmp_path, capsys, 1)
    assert "failed (exit 1) in 0:03: grpo, 1 steps; reward_mean 0.250 -> 0.250" in err
    assert f"[fsdpfn] metrics {tmp_path / 'metrics.jsonl'}\n" in err


def test_resume_is_suggested_once_there_is_something_to_continue(tmp_path, capsys):
    (tmp_path / "sft").mkdir()
    (tmp_path / "sft" / "config.json").write_text("{}")  # the warm-up's result
    err = _summary_lines(tmp_path, capsys, 1)
    assert err.endswith(f"[fsdpfn] continue with: fsdpfn run {tmp_path / 'config.yaml'} "
                        f"--resume\n")


# ---------------------------------------------------------------- one server, two URLs


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from fsdpfn.testing import save_tiny_model, tiny_qwen2_config

    return str(save_tiny_model(tmp_path_factory.mktemp("alias") / "tiny", tiny_qwen2_config(),
                               seed=0))


@pytest.mark.timeout(240)
def test_one_server_under_two_urls_is_refused_before_the_push(tiny_model, tmp_path):
    from fsdpfn.rollout import launch_server
    from fsdpfn.wire.http import call

    mesh = ff.build_mesh(ff.ParallelStrategy(), device_type="cpu")
    state = ff.shard_model(ff.EngineConfig(model_path=tiny_model, dtype="float32"), mesh)
    with launch_server(tiny_model, dtype="float32", log_dir=tmp_path) as server:
        port = server.url.rsplit(":", 1)[1]
        alias = f"http://localhost:{port}"
        server_id = call(server.url, "/get_model_info", timeout=10)["server_id"]
        config = ff.PushConfig(timeout_s=20, init_timeout_s=20)
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError) as info:  # found at the push: the servers' answer
            ff.push_weights(state, ff.RolloutTarget([server.url, alias], config=config))
        assert time.monotonic() - t0 < 10  # refused at once, not after init_timeout_s
        assert (f"urls: '{server.url}' and '{alias}' are one server (server_id {server_id}); "
                f"name each server once") in str(info.value)
        info = call(server.url, "/get_model_info", timeout=10)
        assert info["version"] == 0 and info["groups"] == []  # nothing was sent
        # the server serves on, and one URL of it takes the push
        disk = ff.PushConfig(transport="disk", disk_root=tmp_path / "push", timeout_s=60)
        assert ff.push_weights(state, ff.RolloutTarget([alias], config=disk)).version == 0
