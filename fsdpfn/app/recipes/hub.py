"""``model.path`` naming a model on the Hugging Face hub (``Qwen/Qwen2.5-0.5B``) rather than a
directory, as ``from_pretrained`` takes either.

The launcher resolves such a name once, before any check reads the model: to its snapshot in
the Hugging Face cache (``HF_HUB_CACHE``, ``HF_HOME``), downloading what is missing through
huggingface_hub (``HF_TOKEN`` for gated models; ``HF_HUB_OFFLINE=1`` reads the cache only). The
run then goes on with that directory: config.yaml in run_dir names it, so ``--resume`` reads
the same files and needs no network. Only what the engine reads is fetched: the JSON files, the
tokenizer's, the chat template and the safetensors weights (a repository's PyTorch ``.bin``,
GGUF or ONNX copies are not). ``--dry-run`` fetches all but the weights.

A name that is an existing directory is always the directory; a path (``/``, ``./``, ``~``, a
backslash, more than one ``/``) is never looked up on the hub.

Data files may be files of a hub dataset, as ``datasets`` and huggingface_hub spell them:
``hf://datasets/ORG/NAME/PATH`` (``ORG/NAME@REVISION``: a branch, tag or commit), each fetched
into the same cache and named by its local path from then on (``resolve_hub_files``).
"""

from __future__ import annotations

import re
from pathlib import Path

import attrs

from fsdpfn.errors import ConfigError

__all__ = ["looks_like_hub_id", "resolve_hub_model", "resolve_hub_files", "HUB_PATTERNS",
           "WEIGHT_PATTERNS"]

WEIGHT_PATTERNS = ("*.safetensors",)
HUB_PATTERNS = ("*.json", "*.txt", "*.model", "*.jinja", "*.tiktoken", *WEIGHT_PATTERNS)
# huggingface_hub's own rule for a repository id, one or two segments
_HUB_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]{0,95}/)?[\w.-]{1,96}$")


def looks_like_hub_id(path: str) -> bool:
    """Whether ``path`` (not an existing directory) reads as a hub repository id."""
    return bool(_HUB_ID.match(path)) and not path.startswith((".", "~")) and \
        ".." not in path and not path.endswith((".yaml", ".yml", ".json"))


def resolve_hub_model(cfg, *, weights: bool = True):
    """(``cfg`` with ``model.path`` a local snapshot directory, the launcher's note) where
    ``model.path`` names a hub model; (``cfg``, None) otherwise. ``weights`` False: everything
    but the weights (a dry run). ConfigError when the name is neither a directory nor a model
    the cache or the hub has."""
    path = cfg.model.path
    if path is None or Path(path).expanduser().is_dir() or not looks_like_hub_id(path):
        return cfg, None
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError,
                                            RepositoryNotFoundError, RevisionNotFoundError)
    except ImportError:  # pragma: no cover - transformers depends on it
        return cfg, None
    from huggingface_hub import constants

    weights = weights and not cfg.model.random_init  # random_init: the config and tokenizer
    patterns = [p for p in HUB_PATTERNS if weights or p not in WEIGHT_PATTERNS]
    try:
        local = snapshot_download(path, allow_patterns=patterns)
    except GatedRepoError:
        raise ConfigError(f"model.path: {path!r} is a gated model on the Hugging Face hub: "
                          f"accept its terms on its page and set HF_TOKEN (or run "
                          f"'hf auth login'), got {path!r}") from None
    except (RepositoryNotFoundError, RevisionNotFoundError):
        raise ConfigError(f"model.path: must be an existing directory or a Hugging Face hub "
                          f"model id; no such directory, nor a model of that id on the hub "
                          f"(a private one needs HF_TOKEN), got {path!r}") from None
    except LocalEntryNotFoundError:
        offline = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else \
            "the hub could not be reached"
        raise ConfigError(f"model.path: must be an existing directory or a Hugging Face hub "
                          f"model id; no such directory, and {offline} with no copy of that "
                          f"model in the Hugging Face cache (download it once, 'hf download "
                          f"{path}', or name its directory), got {path!r}") from None
    except Exception as exc:  # noqa: BLE001 - any other hub failure, in one line
        first = (str(exc).splitlines() or [""])[0][:200]
        raise ConfigError(f"model.path: must be an existing directory or a Hugging Face hub "
                          f"model id; fetching it failed ({type(exc).__name__}: {first}), got "
                          f"{path!r}") from None
    from fsdpfn.app.recipes.model import has_weights

    later = not weights and not cfg.model.random_init and not has_weights(Path(local))
    note = (f"model.path: {path} is the Hugging Face hub model in {local}"
            + (" (a dry run fetches all but its weights)" if later else ""))
    return attrs.evolve(cfg, model=attrs.evolve(cfg.model, path=local)), note


_HF_FILE = re.compile(r"^hf://datasets/(?P<repo>[\w.-]+/[\w.-]+)(?:@(?P<rev>[^/]+))?/(?P<path>.+)$")


def resolve_hub_files(cfg):
    """(``cfg`` with every ``hf://datasets/...`` entry of data.train_files and data.eval_files
    its local copy in the Hugging Face cache, the launcher's notes); ConfigError naming the
    key and the entry for one that is malformed, a pattern, or not fetched."""
    data = getattr(cfg, "data", None)
    if data is None or not any(f.startswith("hf://") for f in (*data.train_files,
                                                                   *data.eval_files)):
        return cfg, []
    notes, changes = [], {}
    for key in ("train_files", "eval_files"):
        files = getattr(data, key)
        local = tuple(_hub_file(f"data.{key}", f) if f.startswith("hf://") else f
                      for f in files)
        if local != files:
            changes[key] = local
            notes += [f"data.{key}: {f} is the hub file {p}" for f, p in zip(files, local)
                      if f != p]
    return attrs.evolve(cfg, data=attrs.evolve(data, **changes)), notes


def _hub_file(key: str, url: str) -> str:
    m = _HF_FILE.match(url)
    if m is None:
        raise ConfigError(f"{key}: a hub file is written hf://datasets/ORG/NAME/PATH (or "
                          f"ORG/NAME@REVISION/PATH), got {url!r}")
    repo, rev, path = m["repo"], m["rev"], m["path"]
    if any(c in path for c in "*?["):
        raise ConfigError(f"{key}: name each hub file; patterns are not expanded, got {url!r}")
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import (EntryNotFoundError, GatedRepoError,
                                        LocalEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    try:
        return hf_hub_download(repo, path, repo_type="dataset", revision=rev)
    except GatedRepoError:
        why = f"dataset {repo} is gated: accept its terms on its page and set HF_TOKEN"
    except RepositoryNotFoundError:
        why = f"no dataset {repo} on the hub (a private one needs HF_TOKEN)"
    except RevisionNotFoundError:
        why = f"dataset {repo} has no revision {rev!r}"
    except LocalEntryNotFoundError:
        offline = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else \
            "the hub could not be reached"
        why = (f"{offline} and the Hugging Face cache has no copy of it (download it once: "
               f"'hf download {repo} {path} --repo-type dataset')")
    except EntryNotFoundError:
        why = f"dataset {repo} has no file {path!r}"
    except Exception as exc:  # noqa: BLE001 - any other hub failure, in one line
        first = (str(exc).splitlines() or [""])[0][:200]
        why = f"fetching it failed ({type(exc).__name__}: {first})"
    raise ConfigError(f"{key}: {why}, got {url!r}")
