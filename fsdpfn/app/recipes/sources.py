"""Where a run's model and data files come from, resolved once by the launcher to local paths
that config.yaml then names (so ``--resume`` reads the same files and needs no network).

``model.path`` may name a model on the Hugging Face hub (``Qwen/Qwen2.5-0.5B``) rather than a
directory, as ``from_pretrained`` takes either (``resolve_hub_model``): its snapshot in the
Hugging Face cache (``HF_HUB_CACHE``, ``HF_HOME``), downloading what is missing through
huggingface_hub (``HF_TOKEN`` for gated models; ``HF_HUB_OFFLINE=1`` reads the cache only).
Only what the engine reads is fetched: the JSON files, the tokenizer's, the chat template and
the safetensors weights (a repository's PyTorch ``.bin``, GGUF or ONNX copies are not).
``--dry-run`` fetches all but the weights. A name that is an existing directory is always the
directory; a path (``/``, ``./``, ``~``, a backslash, more than one ``/``) is never looked up
on the hub.

Data files (``resolve_data_files``) may be:
- files of a hub dataset, as ``datasets`` and huggingface_hub spell them,
  ``hf://datasets/ORG/NAME/PATH`` (``ORG/NAME@REVISION``: a branch, tag or commit; PATH may
  be a pattern, ``data/train-*.parquet``, as huggingface_hub matches it), each fetched into
  the same cache;
- a glob pattern (``data/train-*.parquet``, ``**`` for subdirectories), its matching files in
  sorted order;
- a directory, the data files directly inside it (by suffix: .jsonl, .json, .parquet, .csv,
  .tsv) in sorted order.
"""

from __future__ import annotations

import re
from pathlib import Path

import attrs

from fsdpfn.errors import ConfigError
from fsdpfn.wire.hub import (HubError, dataset_file, dataset_files, looks_like_hub_id,
                             model_snapshot)

__all__ = ["looks_like_hub_id", "resolve_hub_model", "resolve_data_files", "resolve_sources"]

_HF_FILE = re.compile(r"^hf://datasets/(?P<repo>[\w.-]+/[\w.-]+)(?:@(?P<rev>[^/]+))?/(?P<path>.+)$")


def resolve_hub_model(cfg, *, weights: bool = True):
    """(``cfg`` with ``model.path`` a local snapshot directory, the launcher's note) where
    ``model.path`` names a hub model; (``cfg``, None) otherwise. ``weights`` False: everything
    but the weights (a dry run). ConfigError when the name is neither a directory nor a model
    the cache or the hub has."""
    path = cfg.model.path
    if path is None or Path(path).expanduser().is_dir() or not looks_like_hub_id(path):
        return cfg, None
    weights = weights and not cfg.model.random_init  # random_init: the config and tokenizer
    try:
        local = model_snapshot(path, weights=weights)
    except HubError as exc:
        raise ConfigError(f"model.path: must be an existing directory or a Hugging Face hub "
                          f"model id; {exc}, got {path!r}") from None
    from fsdpfn.app.recipes.model import has_weights

    later = not weights and not cfg.model.random_init and not has_weights(Path(local))
    note = (f"model.path: {path} is the Hugging Face hub model in {local}"
            + (" (a dry run fetches all but its weights)" if later else ""))
    return attrs.evolve(cfg, model=attrs.evolve(cfg.model, path=local)), note



def resolve_sources(cfg, *, dry_run: bool = False):
    """(``cfg`` with its model and data files local paths, the launcher's notes):
    resolve_hub_model, then resolve_data_files."""
    cfg, model = resolve_hub_model(cfg, weights=not dry_run)
    cfg, files = resolve_data_files(cfg)
    return cfg, [*([model] if model else []), *files]


def resolve_data_files(cfg):
    """(``cfg`` with every hub file, pattern and directory of data.train_files and
    data.eval_files replaced by the local files it names, the launcher's notes); ConfigError
    naming the key and the entry for one that names no file or is not fetched."""
    data = getattr(cfg, "data", None)
    if data is None or not (data.train_files or data.eval_files):
        return cfg, []
    notes, changes = [], {}
    for key in ("train_files", "eval_files"):
        files = getattr(data, key)
        local: list[str] = []
        for entry in files:
            found = _entry_files(f"data.{key}", entry)
            if found != [entry]:
                notes.append(_describe(f"data.{key}", entry, found))
            local += found
        if tuple(local) != files:
            changes[key] = tuple(local)
    if not changes:
        return cfg, []
    return attrs.evolve(cfg, data=attrs.evolve(data, **changes)), notes


def _describe(key: str, entry: str, found: list[str]) -> str:
    if entry.startswith("hf://") and not _pattern(entry):
        return f"{key}: {entry} is the hub file {found[0]}"
    names = [Path(f).name for f in found]
    shown = ", ".join(names) if len(names) <= 4 else f"{', '.join(names[:3])}, ..., {names[-1]}"
    return f"{key}: {entry} is {len(found)} file{'s' if len(found) > 1 else ''} ({shown})"


def _entry_files(key: str, entry: str) -> list[str]:
    """The local files one data entry names: itself (a file, or a missing path, refused later
    by the reader), a hub file's cached copy, a pattern's matches, a directory's data files."""
    if entry.startswith("hf://"):
        return _hub_files(key, entry)
    path = Path(entry).expanduser()
    if path.is_file():
        return [entry]
    if path.is_dir():
        from fsdpfn.app.recipes.data_rows import SUFFIX_FORMAT

        found = sorted(str(f) for f in path.iterdir() if f.is_file() and f.suffix in SUFFIX_FORMAT)
        if not found:
            raise ConfigError(f"{key}: a directory names the data files directly inside it "
                              f"(.jsonl, .json, .parquet, .csv, .tsv), and this one holds none, "
                              f"got {entry!r}")
        return found
    if _pattern(entry):
        import glob

        found = sorted(f for f in glob.glob(str(path), recursive=True) if Path(f).is_file())
        if not found:
            raise ConfigError(f"{key}: no file matches the pattern, got {entry!r}")
        return found
    return [entry]


def _pattern(entry: str) -> bool:
    return any(c in entry for c in "*?[")


def _hub_files(key: str, url: str) -> list[str]:
    """The local copies of a hub file, or of the files a hub pattern matches."""
    m = _HF_FILE.match(url)
    if m is None:
        raise ConfigError(f"{key}: a hub file is written hf://datasets/ORG/NAME/PATH (or "
                          f"ORG/NAME@REVISION/PATH; PATH may be a pattern), got {url!r}")
    repo, rev, path = m["repo"], m["rev"], m["path"]
    try:
        return dataset_files(repo, path, rev) if _pattern(path) else \
            [dataset_file(repo, path, rev)]
    except HubError as exc:
        raise ConfigError(f"{key}: {exc}, got {url!r}") from None
