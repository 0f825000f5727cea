"""``model.path`` may name a model on the Hugging Face hub (``org/name``), as from_pretrained
takes either: the launcher resolves it to its snapshot in the Hugging Face cache (downloading
what is missing), and the run, its config.yaml and ``--resume`` use that directory
(fsdpfn.app.recipes.sources). Data files may be a hub dataset's (``hf://datasets/ORG/NAME/PATH``),
resolved the same way, a glob pattern or a directory.

Nothing is downloaded here: every test runs with HF_HUB_OFFLINE=1 against a cache laid out as
huggingface_hub lays it out (models--org--name/refs/main, snapshots/<commit>/), which
huggingface_hub itself reads."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fsdpfn.app.recipes import default_config
from fsdpfn.app.recipes.sources import looks_like_hub_id, resolve_data_files
from fsdpfn.errors import ConfigError
from fsdpfn.testing import write_tiny_hf_dir

COMMIT = "0123456789abcdef0123456789abcdef01234567"
TEXTS = ["What is 1+1? 2", "What is 2+3? 5", "0123456789+=?"] * 20


def _cache_model(cache: Path, repo: str, source: Path, *, weights: bool = True,
                 kind: str = "models") -> Path:
    """``source``'s files as the snapshot of ``repo`` (a model, or a dataset with ``kind``
    'datasets') in the hub cache ``cache``."""
    org, name = repo.split("/")
    root = cache / f"{kind}--{org}--{name}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(COMMIT)
    snapshot = root / "snapshots" / COMMIT
    shutil.copytree(source, snapshot, ignore=None if weights else
                    shutil.ignore_patterns("*.safetensors"))
    return snapshot


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    model = write_tiny_hf_dir(root / "src", texts=TEXTS, vocab_size=200)
    cache = root / "cache"
    data = root / "data"
    (data / "main").mkdir(parents=True)
    for name, n in (("train.jsonl", 12), ("more.jsonl", 3)):
        (data / "main" / name).write_text("".join(
            json.dumps({"prompt": f"What is {a}+{a}?", "response": str(2 * a)}) + "\n"
            for a in range(n)))
    return {"cache": cache, "snapshot": _cache_model(cache, "acme/tiny", model),
            "meta_only": _cache_model(cache, "acme/noweights", model, weights=False),
            "data": _cache_model(cache, "acme/adds", data, kind="datasets")}


def _run(hub, *args: str, timeout: int = 200) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_CACHE": str(hub["cache"]), "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "fsdpfn", "run", "sft", "launch.nproc=1",
                           "log.plot=false", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_a_hub_id_trains_from_its_cached_snapshot_and_the_run_names_the_directory(hub,
                                                                                  tmp_path):
    run_dir = tmp_path / "run"
    proc = _run(hub, "model.path=acme/tiny", f"run_dir={run_dir}", "steps=2", "batch_size=4")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"[fsdpfn] model.path: acme/tiny is the Hugging Face hub model in {hub['snapshot']}" \
        in proc.stderr.splitlines(), proc.stderr[-3000:]
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["model"]["path"] == str(hub["snapshot"])  # --resume reads the same files
    assert saved["optimizer"]["lr"] == 2e-5  # a hub model is a pretrained model of the user's
    assert (run_dir / "checkpoints" / "step_000002").is_dir()


@pytest.mark.timeout(200)
def test_a_dry_run_reads_all_but_the_weights_and_a_real_run_needs_them(hub, tmp_path):
    proc = _run(hub, "model.path=acme/noweights", f"run_dir={tmp_path / 'dry'}", "--dry-run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (f"[fsdpfn] model.path: acme/noweights is the Hugging Face hub model in "
            f"{hub['meta_only']} (a dry run fetches all but its weights)") in \
        proc.stderr.splitlines(), proc.stderr[-3000:]
    assert f"path: {hub['meta_only']}" in proc.stdout  # the config the run would use
    proc = _run(hub, "model.path=acme/noweights", f"run_dir={tmp_path / 'real'}")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith(
        f"fsdpfn: error: model.path: must hold *.safetensors weights (or set "
        f"model.random_init=true), got '{hub['meta_only']}'"), proc.stderr[-3000:]
    assert not (tmp_path / "real").exists()


@pytest.mark.timeout(120)
def test_an_id_the_cache_lacks_offline_is_refused_in_one_line(hub, tmp_path):
    proc = _run(hub, "model.path=acme/missing", f"run_dir={tmp_path / 'r'}")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "fsdpfn: error: model.path: must be an existing directory or a Hugging Face hub model "
        "id; no such directory, and HF_HUB_OFFLINE is set with no copy of that model in the "
        "Hugging Face cache (download it once, 'hf download acme/missing', or name its "
        "directory), got 'acme/missing'"], proc.stderr[-3000:]
    assert not (tmp_path / "r").exists()
    # a path is never looked up on the hub
    proc = _run(hub, f"model.path={tmp_path / 'nodir'}", f"run_dir={tmp_path / 'r'}")
    assert proc.stderr.strip().splitlines()[-1] == (
        f"fsdpfn: error: model.path: must be an existing directory (or a Hugging Face hub "
        f"model id, org/name), got '{tmp_path / 'nodir'}'")


@pytest.mark.timeout(200)
def test_data_files_of_a_hub_dataset_are_read_from_the_cache(hub, tmp_path):
    url = "hf://datasets/acme/adds/main/train.jsonl"
    local = hub["data"] / "main" / "train.jsonl"
    proc = _run(hub, "model.path=acme/tiny", f"run_dir={tmp_path / 'dry'}", "--dry-run",
                f"data.train_files=[{url}]", "data.max_prompt_tokens=64",
                "data.max_response_tokens=8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    assert f"[fsdpfn] data.train_files: {url} is the hub file {local}" in lines, lines
    assert "[fsdpfn] data (train): 12 of 12 samples" in lines, lines
    assert f"- {local}" in proc.stdout  # the config the run uses names the local copy
    # a pattern: the matching files of the dataset, in sorted order
    pattern = "hf://datasets/acme/adds/main/*.jsonl"
    proc = _run(hub, "model.path=acme/tiny", f"run_dir={tmp_path / 'dry'}", "--dry-run",
                f"data.train_files=[{pattern}]", "data.max_prompt_tokens=64",
                "data.max_response_tokens=8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    assert f"[fsdpfn] data.train_files: {pattern} is 2 files (more.jsonl, train.jsonl)" in lines
    assert "[fsdpfn] data (train): 15 of 15 samples" in lines, lines
    for entry, why in (
            ("hf://datasets/acme/adds/main/test.jsonl",
             "HF_HUB_OFFLINE is set and the Hugging Face cache has no copy of it (download it "
             "once: 'hf download acme/adds main/test.jsonl --repo-type dataset')"),
            ("hf://datasets/acme/adds/main/*.xyz",
             "no file of dataset acme/adds matches 'main/*.xyz'"),
            ("hf://datasets/adds/train.jsonl",
             "a hub file is written hf://datasets/ORG/NAME/PATH (or ORG/NAME@REVISION/PATH; "
             "PATH may be a pattern)")):
        proc = _run(hub, "model.path=acme/tiny", f"run_dir={tmp_path / 'r'}",
                    f"data.eval_files=[{entry}]", f"data.train_files=[{url}]")
        assert proc.returncode == 2
        assert proc.stderr.strip().splitlines()[-1] == \
            f"fsdpfn: error: data.eval_files: {why}, got {entry!r}", proc.stderr[-2000:]
        assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("path, hub_id", [
    ("Qwen/Qwen2.5-0.5B", True), ("gpt2", True), ("meta-llama/Llama-3.2-1B", True),
    ("/models/qwen", False), ("./qwen", False), ("../qwen", False), ("~/qwen", False),
    ("a/b/c", False), ("models\\qwen", False), ("org/name.yaml", False), ("", False),
])
def test_what_reads_as_a_hub_id(path, hub_id):
    assert looks_like_hub_id(path) is hub_id


def _sft(*overrides: str):
    return default_config("sft", ["model.path=/models/m", *overrides])


def test_patterns_and_directories_name_their_data_files_in_sorted_order(tmp_path):
    for name in ("b.jsonl", "a.jsonl", "c.parquet", "notes.txt", "sub/d.jsonl", "sub/e.csv"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("{}")
    (tmp_path / "dir.jsonl").mkdir()  # a directory a pattern matches is no file
    one = str(tmp_path / "a.jsonl")
    cfg = _sft(f"data.train_files=[{tmp_path}/*.jsonl, {one}]",
               f"data.eval_files=[{tmp_path / 'sub'}]")
    got, notes = resolve_data_files(cfg)
    want = [str(tmp_path / n) for n in ("a.jsonl", "b.jsonl", "a.jsonl")]
    assert list(got.data.train_files) == want  # each entry expanded where it stands
    assert list(got.data.eval_files) == [str(tmp_path / "sub" / n) for n in ("d.jsonl", "e.csv")]
    assert notes == [f"data.train_files: {tmp_path}/*.jsonl is 2 files (a.jsonl, b.jsonl)",
                     f"data.eval_files: {tmp_path / 'sub'} is 2 files (d.jsonl, e.csv)"]
    assert cfg.data.train_files[0].endswith("*.jsonl")  # the input config is unchanged
    got, _ = resolve_data_files(_sft(f"data.train_files=[{tmp_path}/**/*.j*]"))
    assert [Path(f).name for f in got.data.train_files] == ["a.jsonl", "b.jsonl", "d.jsonl"]
    # plain files, and a missing one (the reader's to refuse), are left as written
    plain = _sft(f"data.train_files=[{one}, {tmp_path / 'missing.jsonl'}]")
    assert resolve_data_files(plain) == (plain, [])
    for entry, why in ((f"{tmp_path}/*.xyz", "no file matches the pattern"),
                       (str(tmp_path / "dir.jsonl"), "a directory names the data files "
                        "directly inside it (.jsonl, .json, .parquet, .csv, .tsv), and this one "
                        "holds none")):
        with pytest.raises(ConfigError) as err:
            resolve_data_files(_sft(f"data.train_files=[{entry}]"))
        assert str(err.value) == f"data.train_files: {why}, got {entry!r}"


@pytest.mark.timeout(200)
def test_the_rollout_server_serves_a_hub_id_from_the_cache(hub):
    """``python -m fsdpfn.rollout --model ORG/NAME``, as SGLang's --model-path takes one: the
    snapshot in the cache; an id the cache lacks offline ends with one line."""
    from fsdpfn.rollout.process import free_port

    env = {**os.environ, "HF_HUB_CACHE": str(hub["cache"]), "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "fsdpfn.rollout", "--device", "cpu", "--no-channel"]
    proc = subprocess.Popen([*cmd, "--model", "acme/tiny", "--port", str(free_port())],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line.rstrip())
            if "serving" in line or proc.poll() is not None:
                break
        assert f"fsdpfn.rollout: --model acme/tiny is the Hugging Face hub model in " \
            f"{hub['snapshot']}" in lines, lines
        assert lines[-1].startswith(f"fsdpfn.rollout: serving {hub['snapshot']} "), lines
    finally:
        proc.kill()
        proc.wait()
    done = subprocess.run([*cmd, "--model", "acme/missing", "--port", str(free_port())],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        "fsdpfn.rollout: --model acme/missing: must be a model directory (save_pretrained's "
        "layout) or a Hugging Face hub model id; no such directory, and HF_HUB_OFFLINE is set "
        "with no copy of that model in the Hugging Face cache (download it once, 'hf download "
        "acme/missing', or name its directory)")
