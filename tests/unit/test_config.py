"""Configs: YAML/JSON round trips, readable ConfigErrors naming the field, dotted overrides."""

from __future__ import annotations

import shutil

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fsdpfn as ff
from fsdpfn import serde
from fsdpfn.config import DTYPES
from fsdpfn.testing import tiny_qwen2_config

ALL = [ff.ParallelStrategy, ff.OptimizerConfig, ff.FSDPConfig, ff.MicroBatchSpec, ff.LoRAConfig,
       ff.PPOConfig, ff.CriticConfig, ff.AdvantageConfig, ff.SFTConfig, ff.RWConfig, ff.DPOConfig]


def _examples():
    yield from (cls() for cls in ALL)
    yield ff.EngineConfig(model_path="ckpt/")
    yield ff.EngineConfig(model_config=tiny_qwen2_config().to_dict(), is_critic=True,
                          optimizer=None)
    yield ff.EngineConfig(model_config=tiny_qwen2_config().to_dict(), lora=ff.LoRAConfig(rank=4),
                          fsdp=ff.FSDPConfig(wrap_policy=("Qwen2DecoderLayer",)),
                          mb_spec=ff.MicroBatchSpec(max_tokens_per_mb=4096, n_mbs=2))
    yield ff.OptimizerConfig(lr=3e-4, schedule="cosine", warmup_steps=10, total_steps=100,
                             min_lr_ratio=0.1, max_grad_norm=None, betas=(0.8, 0.95))
    yield ff.PPOConfig(clip_low=0.2, clip_high=0.28, dual_clip=3.0, behav_cap=5.0)
    yield ff.AdvantageConfig(estimator="rloo", group_size=4, kl_coef=0.01)


@pytest.mark.parametrize("cfg", list(_examples()), ids=lambda c: type(c).__name__)
def test_round_trips(cfg):
    cls = type(cfg)
    assert serde.from_yaml(serde.to_yaml(cfg), cls) == cfg
    assert serde.from_json(serde.to_json(cfg), cls) == cfg


# field -> values that break its rule (strategies), per class
_neg = st.floats(max_value=0.0, allow_nan=False)
_bad_type = st.sampled_from(["x", [1], {"a": 1}, 1, None])
INVALID = [
    (ff.ParallelStrategy, "tp", st.integers(max_value=0)),
    (ff.ParallelStrategy, "cp", st.integers(max_value=0)),
    (ff.ParallelStrategy, "dp", st.integers(max_value=-2) | st.just(0)),
    (ff.OptimizerConfig, "lr", _neg),
    (ff.OptimizerConfig, "eps", _neg),
    (ff.OptimizerConfig, "weight_decay", st.floats(max_value=-1e-9, allow_nan=False)),
    (ff.OptimizerConfig, "min_lr_ratio", st.floats(min_value=1.0001, max_value=1e6)),
    (ff.OptimizerConfig, "schedule", st.text(min_size=1).filter(
        lambda s: s not in ("constant", "linear", "cosine"))),
    (ff.OptimizerConfig, "warmup_steps", st.integers(max_value=-1)),
    (ff.OptimizerConfig, "max_grad_norm", _neg),
    (ff.FSDPConfig, "offload_params", _bad_type),
    (ff.FSDPConfig, "optim_step_prefetch_layers", st.integers(max_value=-1)),
    (ff.MicroBatchSpec, "max_tokens_per_mb", st.integers(max_value=0)),
    (ff.MicroBatchSpec, "n_mbs", st.integers(max_value=0) | st.floats(0.5, 10.5).filter(
        lambda x: x != int(x))),
    (ff.MicroBatchSpec, "algo", st.text().filter(lambda s: s not in ("lpt", "kk", "ffd"))),
    (ff.PPOConfig, "clip_low", st.floats(min_value=1.0, max_value=1e3) | _neg),
    (ff.PPOConfig, "dual_clip", st.floats(max_value=1.0, allow_nan=False)),
    (ff.PPOConfig, "n_minibatches", st.integers(max_value=0)),
    (ff.PPOConfig, "kl_kind", st.text(min_size=1).filter(lambda s: s not in ("k1", "k2", "k3",
                                                                             "abs"))),
    (ff.CriticConfig, "value_clip", _neg),
    (ff.AdvantageConfig, "estimator", st.text().filter(
        lambda s: s not in ("grpo", "drgrpo", "rloo", "reinforce++", "gae"))),
    (ff.AdvantageConfig, "group_size", st.integers(max_value=0)),
    (ff.AdvantageConfig, "gamma", st.floats(min_value=1.0001, max_value=1e6)),
    (ff.DPOConfig, "beta", _neg),
    (ff.DPOConfig, "kind", st.text().filter(lambda s: s not in ("sigmoid", "ipo"))),
    (ff.EngineConfig, "dtype", st.text().filter(lambda s: s not in ("bfloat16", "float32"))),
    (ff.EngineConfig, "optimizer_dtype", st.sampled_from(["float16", "int8", "fp8"])),
    (ff.EngineConfig, "grad_reduce_dtype", st.text().filter(lambda s: s not in DTYPES)),
    (ff.EngineConfig, "logprobs_chunk_size", st.integers(max_value=0)),
    (ff.EngineConfig, "is_critic", _bad_type),
    (ff.EngineConfig, "seed", st.integers(max_value=-1)),
]


@pytest.mark.parametrize("cls,field,values", INVALID, ids=lambda x: getattr(x, "__name__", None)
                         if isinstance(x, type) else (x if isinstance(x, str) else None))
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_invalid_values_name_the_field(cls, field, values, data):
    value = data.draw(values)
    base = {"model_path": "ckpt/"} if cls is ff.EngineConfig else {}
    with pytest.raises(ff.ConfigError) as info:
        cls(**base, **{field: value})
    assert str(info.value).startswith(f"{field}:"), str(info.value)
    assert "got" in str(info.value)
    # the same through the converter: the dotted path is in front
    parent = {"optimizer": ff.OptimizerConfig, "fsdp": ff.FSDPConfig, "mb_spec": ff.MicroBatchSpec}
    for key, sub in parent.items():
        if sub is cls:
            with pytest.raises(ff.ConfigError) as info:
                serde.structure({"model_path": "x", key: {field: value}}, ff.EngineConfig)
            assert str(info.value).startswith(f"{key}.{field}:"), str(info.value)


def test_error_message_format_and_unknown_keys():
    with pytest.raises(ff.ConfigError, match=r"^optimizer\.lr: must be > 0, got -1\.0$"):
        serde.structure({"model_path": "x", "optimizer": {"lr": -1.0}}, ff.EngineConfig)
    with pytest.raises(ff.ConfigError, match=r"optimizer: unknown key\(s\) \['lrr'\]"):
        serde.structure({"model_path": "x", "optimizer": {"lrr": 1.0}}, ff.EngineConfig)
    with pytest.raises(ff.ConfigError, match=r"unknown key\(s\) \['modelpath'\]"):
        serde.structure({"modelpath": "x"}, ff.EngineConfig)
    with pytest.raises(ff.ConfigError, match="exactly one of model_path and model_config"):
        ff.EngineConfig()
    with pytest.raises(ff.ConfigError, match="total_steps: must be set for schedule 'cosine'"):
        ff.OptimizerConfig(schedule="cosine")


@pytest.mark.parametrize("betas,shown", [([0.9], "(0.9,)"), ([0.9, 0.99, 0.5], "(0.9, 0.99, 0.5)"),
                                         (0.9, "0.9"), ("fast", "'fast'")])
def test_a_tuple_field_read_from_yaml_is_refused_by_its_own_rule(betas, shown):
    """The field's validator names the rule, in the Python API's words; not cattrs' count of
    items ('Not enough values in [0.9] to structure as tuple[float, float]')."""
    message = f"optimizer.betas: must be two numbers in [0, 1), got {shown}"
    with pytest.raises(ff.ConfigError) as info:
        serde.structure({"model_path": "x", "optimizer": {"betas": betas}}, ff.EngineConfig)
    assert str(info.value) == message
    with pytest.raises(ff.ConfigError) as info:
        ff.OptimizerConfig(betas=betas)
    assert "optimizer." + str(info.value) == message
    cfg = serde.structure({"model_path": "x", "optimizer": {"betas": [0.8, 0.95]}},
                          ff.EngineConfig)
    assert cfg.optimizer.betas == (0.8, 0.95)


def test_dotted_overrides(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text(serde.to_yaml(ff.EngineConfig(model_path="ckpt/")))
    cfg = serde.load_config(path, ff.EngineConfig, ["optimizer.lr=1e-6", "mb_spec.n_mbs=4",
                                                    "fsdp.wrap_policy=[A, B]", "dtype=float32"])
    assert cfg.optimizer.lr == 1e-6 and cfg.mb_spec.n_mbs == 4
    assert cfg.fsdp.wrap_policy == ("A", "B") and cfg.dtype == "float32"
    with pytest.raises(ff.ConfigError, match=r"^optimizer\.lr: must be > 0, got -2\.0"):
        serde.load_config(path, ff.EngineConfig, ["optimizer.lr=-2.0"])
    with pytest.raises(ff.ConfigError, match="override: must look like"):
        serde.load_config(path, ff.EngineConfig, ["optimizer.lr"])
    with pytest.raises(ff.ConfigError, match="config: file does not exist"):
        serde.load_config(tmp_path / "missing.yaml", ff.EngineConfig)


def test_configs_are_frozen():
    cfg = ff.PPOConfig()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        cfg.clip_low = 0.3


def test_model_path_accepts_a_pathlib_path(tmp_path):
    cfg = ff.EngineConfig(model_path=tmp_path / "model")
    assert cfg.model_path == str(tmp_path / "model") and isinstance(cfg.model_path, str)
    with pytest.raises(ff.ConfigError, match="model_path: must be a non-empty path string"):
        ff.EngineConfig(model_path=3)


def test_liger_logprobs_impl_refused_where_it_cannot_run():
    """logprobs_impl='liger' needs CUDA and liger-kernel: on CPU shard_model refuses it by name."""
    assert ff.EngineConfig(model_path="x").logprobs_impl == "chunked"
    with pytest.raises(ff.ConfigError, match="logprobs_impl: must be one of"):
        ff.EngineConfig(model_path="x", logprobs_impl="fused")
    from fsdpfn.testing import tiny_qwen2_config

    mesh = ff.build_mesh(ff.ParallelStrategy(dp=1))
    with pytest.raises(ff.ConfigError, match="logprobs_impl: 'liger' needs an actor on CUDA"):
        ff.shard_model(ff.EngineConfig(model_config=tiny_qwen2_config().to_dict(),
                                       logprobs_impl="liger"), mesh)


@pytest.mark.timeout(120)
def test_a_model_dir_of_pytorch_weights_is_refused_naming_the_conversion(tmp_path):
    """shard_model on a directory with pytorch_model-*.bin shards and no safetensors: a
    ConfigError naming model_path, the files and the one-time conversion (never an unpickle)."""
    import torch
    from fsdpfn.testing import save_tiny_model

    mesh = ff.build_mesh(ff.ParallelStrategy(dp=1))
    model = save_tiny_model(tmp_path / "m", tiny_qwen2_config())
    (model / "model.safetensors").unlink()
    for i in range(1, 5):
        torch.save({}, model / f"pytorch_model-0000{i}-of-00004.bin")
    with pytest.raises(ff.ConfigError) as info:
        ff.shard_model(ff.EngineConfig(model_path=str(model), dtype="float32"), mesh)
    assert str(info.value).startswith(
        f"model_path: must hold *.safetensors weights, got {str(model)!r} (it holds PyTorch "
        f"weights, pytorch_model-00001-of-00004.bin, pytorch_model-00002-of-00004.bin, "
        f"pytorch_model-00003-of-00004.bin and 1 more, which fsdpfn does not read: convert "
        f"them once with transformers, AutoModelForCausalLM.from_pretrained(DIR)")


@pytest.mark.timeout(120)
def test_a_model_dir_that_does_not_read_is_refused_naming_the_file(tmp_path):
    """A truncated safetensors file or a config.json that is not JSON: a ConfigError naming
    model_path, the file and the reader's reason, not safetensors' or transformers' own error."""
    from fsdpfn.testing import save_tiny_model

    mesh = ff.build_mesh(ff.ParallelStrategy(dp=1))
    good = save_tiny_model(tmp_path / "good", tiny_qwen2_config())
    truncated = tmp_path / "truncated"
    shutil.copytree(good, truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(ff.ConfigError) as info:
        ff.shard_model(ff.EngineConfig(model_path=str(truncated), dtype="float32"), mesh)
    assert str(info.value) == (f"model_path: each *.safetensors file must be a readable "
                               f"safetensors file, got {str(weights)!r} (Error while "
                               f"deserializing header: incomplete metadata, file not fully "
                               f"covered)")
    corrupt = tmp_path / "corrupt"
    shutil.copytree(good, corrupt)
    (corrupt / "config.json").write_text("{oops")
    with pytest.raises(ff.ConfigError) as info:
        ff.shard_model(ff.EngineConfig(model_path=str(corrupt), dtype="float32"), mesh)
    assert str(info.value) == (f"model_path: config.json must be a readable transformers "
                               f"config, got {str(corrupt / 'config.json')!r} (Expecting "
                               f"property name enclosed in double quotes: line 1 column 2 "
                               f"(char 1))")


# ---------------------------------------------------------------- reading YAML: one-line errors


def test_yaml_syntax_errors_give_line_and_column(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model_path: x\noptimizer:\n  lr: 1\n    eps: 2\n")
    with pytest.raises(ff.ConfigError) as info:
        serde.load_config(path, ff.EngineConfig)
    msg = str(info.value)
    assert msg.startswith(f"config {str(path)!r}: YAML syntax error at line 4, column 8: "), msg
    assert "mapping values are not allowed here" in msg and "\n" not in msg
    with pytest.raises(ff.ConfigError, match=r"^config: YAML syntax error at line 2, column 1: "
                                             r"expected ',' or ']'"):
        serde.load_yaml("a: [1, 2\n")
    with pytest.raises(ff.ConfigError, match=r"^override 'steps=\[1': YAML syntax error at "
                                             r"line 1, column 3"):
        serde.apply_overrides({}, ["steps=[1"])
    (tmp_path / "bad.json").write_text('{"model_path": "x",\n "dtype": }')
    with pytest.raises(ff.ConfigError, match=r"JSON syntax error at line 2, column 11"):
        serde.load_config(tmp_path / "bad.json", ff.EngineConfig)


def test_duplicate_keys_are_refused_naming_key_and_lines(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("model_path: x\noptimizer:\n  lr: 0.1\n  eps: 1.0e-8\n  lr: 0.2\n")
    with pytest.raises(ff.ConfigError, match=r"duplicate key 'lr' at line 5, column 3 \(first "
                                             r"at line 3, column 3\): a key may appear once"):
        serde.load_config(path, ff.EngineConfig)
    with pytest.raises(ff.ConfigError, match=r"^override 'fsdp=\{a: 1, a: 2\}': duplicate key "
                                             r"'a' at line 1, column 8"):
        serde.apply_overrides({}, ["fsdp={a: 1, a: 2}"])
    (tmp_path / "dup.json").write_text('{"model_path": "x", "model_path": "y"}')
    with pytest.raises(ff.ConfigError, match="duplicate key 'model_path'"):
        serde.load_config(tmp_path / "dup.json", ff.EngineConfig)
    # the same key in different mappings, and a merge key that a later key overrides, are fine
    assert serde.load_yaml("a: {x: 1}\nb: {x: 2}\nbase: &b {x: 3}\nc:\n  <<: *b\n  x: 4\n") == \
        {"a": {"x": 1}, "b": {"x": 2}, "base": {"x": 3}, "c": {"x": 4}}


@settings(max_examples=30, deadline=None)
@given(keys=st.lists(st.from_regex(r"[a-z]{1,6}", fullmatch=True), min_size=1, max_size=6))
def test_yaml_mappings_load_as_pyyaml_unless_a_key_repeats(keys):
    import yaml

    text = "".join(f"{k}: {i}\n" for i, k in enumerate(keys))
    read = [next(iter(yaml.safe_load(f"{k}: 0"))) for k in keys]  # 'on' and 'yes' read as True
    if len(set(read)) == len(read):
        assert serde.load_yaml(text) == yaml.safe_load(text)
    else:
        at = next(i for i, k in enumerate(read) if k in read[:i])
        with pytest.raises(ff.ConfigError, match=f"duplicate key '{keys[at]}'"):
            serde.load_yaml(text)


def test_a_duplicate_key_is_named_as_written_and_as_read():
    for text, words in (("on: 1\non: 2\n", "duplicate key 'on' (read as True) at line 2"),
                        ("on: 1\nyes: 2\n", "duplicate key 'yes' (read as True) at line 2"),
                        ("lr: 1\nlr: 2\n", "duplicate key 'lr' at line 2")):
        with pytest.raises(ff.ConfigError) as info:
            serde.load_yaml(text)
        assert words in str(info.value), str(info.value)


def test_a_section_given_a_scalar_is_named():
    for value in (5, "x", [1], True):
        with pytest.raises(ff.ConfigError) as info:
            serde.structure({"model_path": "x", "optimizer": value}, ff.EngineConfig)
        assert str(info.value) == f"optimizer: must be a mapping (section), got {value!r}"
    with pytest.raises(ff.ConfigError, match=r"^mb_spec: must be a mapping \(section\), got 3$"):
        serde.structure(serde.apply_overrides({"model_path": "x"}, ["mb_spec=3"]),
                        ff.EngineConfig)
    with pytest.raises(ff.ConfigError, match=r"^model_config: must be a mapping, got 5$"):
        serde.structure({"model_config": 5}, ff.EngineConfig)
    # an optional section may still be null
    assert serde.structure({"model_path": "x", "optimizer": None}, ff.EngineConfig).optimizer \
        is None


def test_import_fsdpfn_is_lazy_and_complete():
    """``import fsdpfn`` (and the CLI's config path, a recipe's server flags and sampling
    parameters included) does not import torch; every name of __all__ still resolves, and
    dir() lists them."""
    import subprocess
    import sys

    code = ("import sys, fsdpfn, fsdpfn.app.cli, fsdpfn.serde, fsdpfn.app.recipes\n"
            "from fsdpfn.errors import ConfigError\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n"
            "rc = fsdpfn.app.cli.main(['run', 'sft', 'optimizer.lrr=1'])\n"
            "assert rc == 2 and 'torch' not in sys.modules, rc\n"
            # the checks of the servers' flags and sampling parameters are torch-free too
            "from fsdpfn.app.recipes import default_config\n"
            "c = default_config('grpo', ['rollout.server_args=[--decode, hf]',\n"
            "                            'rollout.sampling={top_k: 3, repetition_penalty: 1.1}'])\n"
            "assert c.rollout.sampling['top_k'] == 3 and 'torch' not in sys.modules\n"
            "import fsdpfn as ff\n"
            "assert ff.build_mesh.__name__ == 'build_mesh' and 'torch' in sys.modules\n"
            "from fsdpfn import ppo_step, keys, MicroBatchOOMError\n"
            "import torch; assert issubclass(MicroBatchOOMError, torch.OutOfMemoryError)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "unknown key(s) ['lrr']" in proc.stderr
    assert all(getattr(ff, name) is not None for name in ff.__all__)
    assert set(ff.__all__) <= set(dir(ff))
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        ff.nope  # noqa: B018


def test_microbatch_algo_names_what_runs_and_keeps_its_old_name():
    assert ff.MicroBatchSpec().algo == "lpt"
    for algo in ("lpt", "kk", "ffd"):  # "ffd": the former name of lpt, still accepted
        spec = serde.from_yaml(f"algo: {algo}\n", ff.MicroBatchSpec)
        assert spec == ff.MicroBatchSpec(algo=algo)


def test_an_empty_wrap_policy_is_refused_rather_than_read_as_the_default():
    """wrap_policy=[] passed the list check and then read as None (the model's
    _no_split_modules), wrapping the default classes without a word."""
    with pytest.raises(ff.ConfigError, match=r"^wrap_policy: must name at least one module class "
                                          r"\(or be None: the model's _no_split_modules\), "
                                          r"got \(\)$"):
        ff.FSDPConfig(wrap_policy=[])


PUBLIC_CONFIGS = ["ParallelStrategy", "EngineConfig", "OptimizerConfig", "FSDPConfig",
                  "MicroBatchSpec", "LoRAConfig", "PPOConfig", "CriticConfig", "AdvantageConfig",
                  "SFTConfig", "RWConfig", "DPOConfig"]


@pytest.mark.parametrize("name", PUBLIC_CONFIGS)
def test_an_array_for_any_field_is_a_config_error_naming_it(name):
    """An array's ``in`` and truth are elementwise or ambiguous: a field checked against a list
    of choices (``agg``, ``dtype``) or a special value (``dp=-1``) once raised numpy's or
    torch's own ValueError/RuntimeError naming no field."""
    import numpy as np
    import torch

    cls = getattr(ff, name)
    for field in attrs.fields(cls):
        for value in (np.array([1, 2]), np.array(["a", "b"]), torch.tensor([1, 2])):
            kw = {field.name: value}
            if cls is ff.EngineConfig and field.name != "model_path":
                kw["model_path"] = "/nonexistent-model"
            try:
                cls(**kw)
            except ff.ConfigError as exc:
                assert str(exc).startswith(f"{field.name}: "), exc
            else:
                raise AssertionError(f"{name}.{field.name}={value!r} was accepted")


@pytest.mark.parametrize("fields, rule", [
    ({"lr": 1e38}, r"^lr: must keep AdamW's first step size lr / \(1 - betas\[0\]\) within "
                   r"float32's range \(3.4e38; betas\[0\] = 0.9\), got 1e\+38$"),
    ({"lr": 4e37}, r"^lr: must keep AdamW's first step size .*, got 4e\+37$"),
    ({"lr": 1e30, "betas": (1 - 1e-9, 0.999)}, r"^lr: must keep .*betas\[0\] = 0.999999999\), "
                                               r"got 1e\+30$"),
    ({"lr": 1e37, "weight_decay": 100.0}, r"^weight_decay: must keep lr \* weight_decay within "
                                          r"float32's range \(3.4e38; lr = 1e\+37\), got 100.0$"),
])
def test_an_lr_whose_first_adamw_step_overflows_float32_is_refused(fields, rule):
    """lr=1e38 was accepted; AdamW's first step then raised torch's RuntimeError halfway through
    the parameters, leaving a partial update behind an error that named no field."""
    with pytest.raises(ff.ConfigError, match=rule):
        ff.OptimizerConfig(**fields)


def test_the_largest_lr_the_first_step_holds_is_accepted():
    assert ff.OptimizerConfig(lr=3e37).lr == 3e37
    assert ff.OptimizerConfig(lr=3e38, betas=(0.0, 0.999)).lr == 3e38
