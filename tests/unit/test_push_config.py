"""PushConfig: RolloutTarget's push options as one validated frozen value; RolloutTarget takes it
as ``config=`` and nothing else (no keyword options, no options read back as attributes)."""

from __future__ import annotations

from pathlib import Path

import attrs
import re

import pytest

import fsdpfn as ff
from fsdpfn.weights import PushConfig, RolloutTarget
from fsdpfn.weights.push_config import TRANSPORTS

URL = "http://127.0.0.1:30000"

# the documented defaults, written out by hand
DEFAULTS = {"transport": "broadcast", "dtype": None, "bucket_bytes": 1 << 30,
            "backend": None, "timeout_s": 300.0, "init_timeout_s": 120.0,
            "pause_generation": True, "flush_cache": True, "precheck": True,
            "disk_root": None, "keep_last": 2, "master_address": None, "master_port": None,
            "group_name": None, "on_bucket": None, "edge_bucket_bytes": 256 << 20,
            "pause_mode": "abort", "probe_tol": None}

SOME = {"transport": "disk", "disk_root": "/tmp/push", "dtype": "bfloat16",
        "bucket_bytes": 4096, "backend": "gloo", "timeout_s": 30, "init_timeout_s": 7,
        "pause_generation": False, "keep_last": 3, "master_port": 29555, "group_name": "g",
        "edge_bucket_bytes": None, "pause_mode": "retract", "probe_tol": 0.5}


def test_defaults_are_the_documented_ones():
    assert set(attrs.fields_dict(PushConfig)) == set(DEFAULTS)
    cfg = RolloutTarget(URL).config
    assert {k: getattr(cfg, k) for k in DEFAULTS if k != "group_name"} == \
        {k: v for k, v in DEFAULTS.items() if k != "group_name"}


def test_the_config_is_the_one_way_to_give_options():
    cfg = PushConfig(**SOME)
    target = RolloutTarget(URL, config=cfg)
    assert target.config == cfg
    assert cfg.disk_root == Path("/tmp/push") and cfg.timeout_s == 30.0
    assert type(cfg.timeout_s) is float and type(cfg.init_timeout_s) is float
    assert repr(target) == f"RolloutTarget(['{URL}'], transport='disk')"
    for name in SOME:  # not read back as attributes of the target
        assert not hasattr(target, name), name
    with pytest.raises(TypeError):
        RolloutTarget(URL, timeout_s=30)  # keywords are not options
    for removed in ("pipeline", "one_request", "channel"):  # switches of removed paths
        with pytest.raises(TypeError):
            PushConfig(**{removed: False})


def test_group_name_is_filled_per_target_unless_given():
    shared = PushConfig()
    a, b = RolloutTarget(URL, config=shared), RolloutTarget(URL, config=shared)
    assert shared.group_name is None
    assert a.config.group_name.startswith("fsdpfn-")
    assert a.config.group_name != b.config.group_name
    assert a.config == attrs.evolve(shared, group_name=a.config.group_name)
    assert RolloutTarget(URL, config=PushConfig(group_name="mine")).config.group_name == "mine"


@pytest.mark.parametrize("field,value,rule", [
    ("transport", "nccl", "must be 'broadcast', 'disk' or 'ipc'"),
    ("transport", None, "must be 'broadcast', 'disk' or 'ipc'"),
    ("dtype", "int8", "dtype must be one of"),
    ("bucket_bytes", 0, "must be an int >= 1"),
    ("bucket_bytes", 1.5, "must be an int >= 1"),
    ("backend", "mpi", "must be None, 'gloo' or 'nccl'"),
    ("timeout_s", 0, "must be a number > 0"),
    ("timeout_s", "30", "must be a number > 0"),
    ("init_timeout_s", -1.0, "must be a number > 0"),
    ("keep_last", 0, "must be an int >= 1"),
    ("disk_root", 5, "must be None or a directory path"),
    ("edge_bucket_bytes", 0, "must be None or an int >= 1"),
    ("pause_mode", "stop", "must be one of ('abort', 'retract', 'in_place')"),
    ("probe_tol", -0.1, "must be None or a number >= 0"),
    ("probe_tol", True, "must be None or a number >= 0"),
    ("on_bucket", 5, "must be None or a callable (index, n_buckets)"),
    ("master_address", "", "must be None or a host name or address"),
    # a string "false" was truthy: the push paused, flushed or prechecked all the same
    ("pause_generation", "false", "must be a bool"),
    ("flush_cache", 0, "must be a bool"),
    ("precheck", None, "must be a bool"),
    ("group_name", "", "must be None or a non-empty string without whitespace"),
    ("group_name", "my group", "must be None or a non-empty string without whitespace"),
    ("group_name", 7, "must be None or a non-empty string without whitespace"),
])
def test_a_bad_option_is_a_config_error_naming_field_rule_and_value(field, value, rule):
    with pytest.raises(ff.ConfigError) as info:
        PushConfig(**{field: value})
    message = str(info.value)
    assert message.startswith(f"{field}: ") and rule in message, message
    assert repr(value) in message or repr(float(value)) in message, message


def test_transport_is_a_closed_choice_and_disk_needs_a_root():
    assert TRANSPORTS == ("broadcast", "disk", "ipc")
    for transport in TRANSPORTS:
        root = "/tmp/push" if transport == "disk" else None
        assert PushConfig(transport=transport, disk_root=root).transport == transport
    with pytest.raises(ff.ConfigError, match=r"disk_root: must be set for transport='disk'.*"
                                             r"got None"):
        PushConfig(transport="disk")


def test_misuse_of_the_constructor_is_refused():
    with pytest.raises(ff.ConfigError, match="config: must be a PushConfig, got dict"):
        RolloutTarget(URL, config={"timeout_s": 3})
    with pytest.raises(ff.ConfigError, match="urls: must be one or more"):
        RolloutTarget("127.0.0.1:30000")
    for urls in (None, 123, {"url": URL}):
        with pytest.raises(ff.ConfigError, match=rf"^urls: must be one or more 'http://host:port' "
                                                 rf"strings, got {urls!r}$".replace("{", r"\{")):
            RolloutTarget(urls)
    with pytest.raises(ff.ConfigError, match=rf"^urls: must name each server once .*got "
                                             rf"'{URL}' 2 times$"):
        RolloutTarget([URL, URL + "/"])
    target = RolloutTarget(URL)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        target.config.timeout_s = 3  # type: ignore[misc]
    assert target.last_apply_s is None  # nothing pushed yet


def test_push_config_is_exported_at_the_top_level():
    assert ff.PushConfig is PushConfig and "PushConfig" in ff.__all__


def test_each_transport_implements_the_sender_protocol():
    """The four transports are each a fsdpfn.weights.gather.Sender, driven by gather.send."""
    import inspect

    from fsdpfn.weights.channel import ChannelSender
    from fsdpfn.weights.disk import _Writer
    from fsdpfn.weights.gather import Sender
    from fsdpfn.weights.ipc import IpcSender
    from fsdpfn.weights.sglang import SGLangSender

    methods = [n for n, v in vars(Sender).items() if inspect.isfunction(v) and n[0] != "_"]
    fields = list(Sender.__annotations__)
    assert sorted(methods) == ["abandon", "conclude", "finish", "start"]
    assert sorted(fields) == ["flat", "start_before_finish"]
    for cls in (ChannelSender, SGLangSender, IpcSender, _Writer):
        for name in methods:
            assert inspect.isfunction(getattr(cls, name, None)), (cls.__name__, name)
        for name in fields:
            assert isinstance(getattr(cls, name, None), bool), (cls.__name__, name)


@pytest.mark.parametrize("url", ["http://", "http://host:notaport", "ftp://host:1",
                                 "http://host:70000", "http://host:0", "localhost:30000",
                                 " http://host:1", "http://host:1?x=1", "http://host:1#a"])
def test_a_url_without_scheme_host_or_numeric_port_is_refused_when_the_target_is_built(url):
    with pytest.raises(ff.ConfigError) as info:
        RolloutTarget(url)
    assert str(info.value) == ("urls: must be one or more 'http://host:port' strings (http or "
                               f"https, a host, a port if any in 1..65535, no query or spaces), "
                               f"got {url!r}")
    with pytest.raises(ff.ConfigError, match=re.escape(f"got {url!r} in {[URL, url]!r}") + "$"):
        RolloutTarget([URL, url])
    for good in ("https://rollout.example", "http://[::1]:30000", f"{URL}/v1/"):
        assert RolloutTarget(good).urls == [good.rstrip("/")]


@pytest.mark.parametrize("port", [70000, 65536, -1, True, "29500"])
def test_master_port_must_be_a_port_number(port):
    with pytest.raises(ff.ConfigError) as info:
        PushConfig(master_port=port)
    assert str(info.value) == ("master_port: must be None or a port number in 0..65535 (None or "
                               f"0: a free port), got {port!r}")
    assert PushConfig(master_port=65535).master_port == 65535
    assert PushConfig(master_port=0).master_port == 0  # as None: the group takes a free port


def test_servers_of_different_dtypes_ask_for_the_dtype_the_way_it_is_given():
    """The message's advice is the API: RolloutTarget(urls, config=PushConfig(dtype=...))."""
    from fsdpfn.errors import WeightSyncError

    other = "http://127.0.0.1:30001"
    infos = {URL: {"dtype": "bfloat16"}, other: {"dtype": "float32"}}
    with pytest.raises(WeightSyncError) as info:
        RolloutTarget([URL, other])._servers._push_dtype(infos)
    assert str(info.value) == ("dtype: the servers serve different dtypes {'http://127.0.0.1:"
                               "30000': 'bfloat16', 'http://127.0.0.1:30001': 'float32'}; pass "
                               "one explicitly: RolloutTarget(urls, "
                               "config=PushConfig(dtype=...))")
    target = RolloutTarget([URL, other], config=PushConfig(dtype="float32"))
    assert target._servers._push_dtype(infos) == "float32"


@pytest.mark.timeout(120)
def test_push_weights_to_a_wrong_target_shows_the_value_received():
    from fsdpfn.testing import tiny_qwen2_config

    mesh = ff.build_mesh(ff.ParallelStrategy(dp=1))
    state = ff.shard_model(ff.EngineConfig(model_config=tiny_qwen2_config().to_dict(),
                                           optimizer=None, dtype="float32"), mesh)
    rule = "target: must be a DiskTarget or RolloutTarget (an object with push(state)), got"
    long = "x" * 200
    for target, shown in [(URL, f"{URL!r} (str); for the server at that URL pass "
                                f"RolloutTarget({URL!r})"),
                          (None, "None (NoneType)"), (42, "42 (int)"),
                          (long, f"'{long[:76]}... (str)")]:
        with pytest.raises(ff.ConfigError) as info:
            ff.push_weights(state, target)
        assert str(info.value) == f"{rule} {shown}"
    assert state.version == 0 and ff.forward_logp(state, ff.testing.random_batch(
        2, 8, vocab_size=tiny_qwen2_config().vocab_size))["logp"].shape == (2, 8)


def test_a_disk_target_refuses_a_root_it_cannot_publish_under(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory")
    for root, rule in (("", "must be a directory path (a non-empty str or os.PathLike), got ''"),
                       (5, "must be a directory path (a non-empty str or os.PathLike), got 5"),
                       (str(a_file), f"must be a directory (or not exist yet), got "
                                     f"{str(a_file)!r}, which is a file")):
        with pytest.raises(ff.ConfigError) as info:
            ff.DiskTarget(root)
        assert str(info.value) == f"root: {rule}"
    for field, value in (("keep_last", True), ("keep_last", 0), ("bucket_bytes", False)):
        with pytest.raises(ff.ConfigError, match=rf"^{field}: must be an int >= 1, got {value}$"):
            ff.DiskTarget(tmp_path / "push", **{field: value})
    assert a_file.read_text() == "not a directory" and not (tmp_path / "push").exists()
