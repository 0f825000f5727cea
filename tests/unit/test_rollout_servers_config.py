"""Several rollout servers in a recipe's config: rollout.gpus (one server per GPU), rollout.servers
(a count, for the CPU or the last GPUs), rollout.url as a list; where they are placed, and every
bad combination refused before launch with the key, the rule and the value."""

from __future__ import annotations

import pytest

from fsdpfn.app.recipes import default_config
from fsdpfn.app.recipes import placement as P
from fsdpfn.app.recipes.config import RolloutConfig
from fsdpfn.app.launcher import _describe, _worker_cmd
from fsdpfn.errors import ConfigError


def place(n_gpus, *overrides, recipe="grpo"):
    cfg = default_config(recipe, list(overrides))
    return P.place(cfg, n_gpus, needs_rollout=recipe in ("grpo", "ppo"))


def test_four_train_four_serve_on_eight_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    p = place(8, "rollout.gpus=[4, 5, 6, 7]")
    assert p.servers == 4 and p.server_gpus == (4, 5, 6, 7)
    assert p.trainer_gpus == (0, 1, 2, 3) and p.nproc == 4 and p.transport == "broadcast"
    assert [p.server_env(i) for i in range(4)] == [{"CUDA_VISIBLE_DEVICES": str(g)}
                                                  for g in (4, 5, 6, 7)]
    assert "4 servers on cuda GPU [4, 5, 6, 7]" in _describe(p)
    # a count takes the host's last GPUs
    q = place(8, "rollout.servers=2")
    assert q.server_gpus == (6, 7) and q.trainer_gpus == tuple(range(6)) and q.servers == 2


def test_servers_on_the_cpu_and_one_server_as_before():
    p = place(0, "rollout.servers=2")
    assert (p.device, p.server_device, p.servers, p.server_gpus, p.transport) == \
        ("cpu", "cpu", 2, (), "broadcast")
    assert p.server_env(0) == {} and "2 servers" in _describe(p)
    one = place(0)
    assert one.servers == 1 and "servers" not in _describe(one)
    assert place(1).server_gpus == (0,) and place(1).transport == "ipc"  # one GPU, shared
    assert place(0, "rollout.url=[http://127.0.0.1:1, http://127.0.0.1:2]").servers == 0


def test_a_url_list_reaches_the_ranks_as_one_argument(tmp_path):
    cfg = default_config("grpo", ["rollout.url=[http://127.0.0.1:1, http://127.0.0.1:2/]"])
    assert cfg.rollout.url == "http://127.0.0.1:1,http://127.0.0.1:2"
    assert cfg.rollout.urls == ("http://127.0.0.1:1", "http://127.0.0.1:2")
    assert cfg.rollout.n_servers == 2
    cmd = _worker_cmd(cfg, tmp_path / "c.yaml", place(0), resume=False, url=cfg.rollout.url)
    assert cmd[cmd.index("--rollout-url") + 1] == "http://127.0.0.1:1,http://127.0.0.1:2"
    # comma-separated works the same
    assert default_config("grpo", ["rollout.url=http://127.0.0.1:1,http://127.0.0.1:2"]) \
        .rollout.urls == cfg.rollout.urls


def test_gpus_may_be_one_index_or_a_comma_separated_string():
    assert default_config("grpo", ["launch.gpus=3"]).launch.gpus == (3,)
    assert default_config("grpo", ["launch.gpus=0,1"]).launch.gpus == (0, 1)
    assert default_config("grpo", ["rollout.gpus=[2, 3]"]).rollout.gpus == (2, 3)


@pytest.mark.parametrize("overrides,message", [
    (["rollout.servers=0"], r"^rollout.servers: must be >= 1, got 0$"),
    (["rollout.servers=1.5"], r"^rollout.servers: must be an integer, got 1.5$"),
    (["rollout.gpus=[4, 5]", "rollout.servers=3"],
     r"^rollout.servers: must equal the number of rollout.gpus \(one server per GPU listed: "
     r"\[4, 5\]\), got 3$"),
    (["rollout.gpus=[4, 4]"],
     r"^rollout.gpus: must be null or a list of distinct GPU indices >= 0, got \[4, 4\]$"),
    (["launch.gpus=3.5"],
     r"^launch.gpus: must be null or a list of distinct GPU indices >= 0, got 3.5$"),
    (["launch.gpus=[[0]]"],
     r"^launch.gpus: must be null or a list of distinct GPU indices >= 0, got \[\[0\]\]$"),
    (["rollout.url=[http://127.0.0.1:1, 127.0.0.1:2]"],
     r"^rollout.url: must name each server as 'http://host:port', got '127.0.0.1:2' in "
     r"\['http://127.0.0.1:1', '127.0.0.1:2'\]$"),
    (["rollout.url=http://:8000"], r"^rollout.url: must name each server as 'http://host:port', "
                                   r"got 'http://:8000'$"),
    (["rollout.url=http://127.0.0.1:port"],
     r"^rollout.url: must name each server as 'http://host:port', got 'http://127.0.0.1:port'$"),
    (["rollout.url=[http://127.0.0.1:1, http://127.0.0.1:1]"],
     r"^rollout.url: must name each server once, got 'http://127.0.0.1:1' twice"),
    (["rollout.url=[]"], r"^rollout.url: must be None, 'http://host:port' or a list of them"),
    (["rollout.url=[http://127.0.0.1:1]", "rollout.servers=2"],
     r"^rollout.servers: must equal the number of servers rollout.url lists \(1; fsdpfn run "
     r"starts none then\), got 2$"),
])
def test_bad_server_settings_are_refused_by_the_config(overrides, message):
    with pytest.raises(ConfigError, match=message):
        default_config("grpo", overrides)


@pytest.mark.parametrize("n_gpus,overrides,message", [
    (8, ["launch.gpus=[0, 1, 2, 4]", "rollout.gpus=[4, 5, 6, 7]"],
     r"^launch.gpus: with 4 rollout servers no trainer GPU may also serve \(rollout.gpus "
     r"\[4, 5, 6, 7\]\); GPU 4 is in both, got \[0, 1, 2, 4\]$"),
    (2, ["rollout.gpus=[0, 1]"],
     r"^rollout.gpus: 2 servers on GPUs of their own leave none of this host's 2 GPUs to the "
     r"trainer, got \[0, 1\]$"),
    (2, ["rollout.servers=2"],
     r"^rollout.servers: 2 servers on GPUs of their own and a trainer GPU need 3 GPUs, this "
     r"host has 2; got 2$"),
    (8, ["rollout.gpus=[6, 7]", "rollout.transport=ipc"],
     r"^rollout.transport: 'ipc' hands CUDA memory of trainer rank 0's GPU to a server on "
     r"that GPU, and 2 servers each hold a GPU of their own \(\[6, 7\]\); use auto, "
     r"broadcast or disk, got 'ipc'$"),
    (4, ["rollout.gpus=[2, 9]"], r"^rollout.gpus: GPU indices must be < 4"),
])
def test_bad_placements_of_several_servers_are_refused(n_gpus, overrides, message):
    with pytest.raises(ConfigError, match=message):
        place(n_gpus, *overrides)


def test_disk_pushes_to_several_servers_and_the_count_defaults_to_the_gpus():
    assert place(8, "rollout.gpus=[6, 7]", "rollout.transport=disk").transport == "disk"
    assert RolloutConfig(gpus=(1, 2, 3)).n_servers == 3 and RolloutConfig().n_servers == 1
