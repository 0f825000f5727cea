"""Models and dataset files on the Hugging Face hub, fetched into its local cache through
huggingface_hub, for the launcher (``model.path``, ``hf://datasets/...`` data files:
fsdpfn.app.recipes.sources) and the rollout server (``--model``), which both take a hub id
where they take a directory.

The cache is huggingface_hub's (``HF_HUB_CACHE``, ``HF_HOME``); ``HF_TOKEN`` reaches gated and
private repositories, ``HF_HUB_OFFLINE=1`` reads the cache alone. Of a model, only what fsdpfn
reads is fetched: the JSON files, the tokenizer's, the chat template and the safetensors
weights (a repository's PyTorch ``.bin``, GGUF or ONNX copies are not). A failure is a
``HubError`` whose text is one phrase the caller puts in its own line.
"""

from __future__ import annotations

import re

__all__ = ["HubError", "HUB_PATTERNS", "WEIGHT_PATTERNS", "looks_like_hub_id",
           "model_snapshot", "dataset_file", "dataset_files"]

WEIGHT_PATTERNS = ("*.safetensors",)
HUB_PATTERNS = ("*.json", "*.txt", "*.model", "*.jinja", "*.tiktoken", *WEIGHT_PATTERNS)
# huggingface_hub's own rule for a repository id, one or two segments
_HUB_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]{0,95}/)?[\w.-]{1,96}$")


class HubError(Exception):
    """Why a hub model or file could not be had, as one phrase."""


def looks_like_hub_id(path: str) -> bool:
    """Whether ``path`` (not an existing directory) reads as a hub repository id: a path
    (``/``, ``./``, ``~``, ``..``, a backslash, more than one ``/``) or a config file name
    never does."""
    return bool(_HUB_ID.match(path)) and not path.startswith((".", "~")) and \
        ".." not in path and not path.endswith((".yaml", ".yml", ".json"))


def _offline() -> str:
    from huggingface_hub import constants

    return "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the hub could not be reached"


def _first_line(exc: Exception) -> str:
    return f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"


def model_snapshot(repo: str, *, weights: bool = True) -> str:
    """The local directory of hub model ``repo``'s snapshot, fetching the files it lacks (all
    but the weights when ``weights`` is False). HubError: why there is none."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    patterns = [p for p in HUB_PATTERNS if weights or p not in WEIGHT_PATTERNS]
    try:
        return snapshot_download(repo, allow_patterns=patterns)
    except GatedRepoError:
        why = (f"{repo} is a gated model on the hub: accept its terms on its page and set "
               f"HF_TOKEN (or run 'hf auth login')")
    except (RepositoryNotFoundError, RevisionNotFoundError):
        why = "no such directory, nor a model of that id on the hub (a private one needs HF_TOKEN)"
    except LocalEntryNotFoundError:
        why = (f"no such directory, and {_offline()} with no copy of that model in the Hugging "
               f"Face cache (download it once, 'hf download {repo}', or name its directory)")
    except Exception as exc:  # noqa: BLE001 - any other hub failure, in one line
        why = f"fetching it failed ({_first_line(exc)})"
    raise HubError(why)


def dataset_file(repo: str, path: str, revision: str | None = None) -> str:
    """The local copy of file ``path`` of hub dataset ``repo`` (at ``revision``), fetched when
    the cache lacks it. HubError: why there is none."""
    from huggingface_hub import hf_hub_download

    try:
        return hf_hub_download(repo, path, repo_type="dataset", revision=revision)
    except Exception as exc:  # noqa: BLE001 - every hub failure, in one phrase
        raise HubError(_dataset_why(exc, repo, revision, path, copy_of="it",
                                    download=f"{repo} {path}")) from None


def dataset_files(repo: str, pattern: str, revision: str | None = None) -> list[str]:
    """The local copies of the files of hub dataset ``repo`` (at ``revision``) that
    ``pattern`` matches (huggingface_hub's allow_patterns: fnmatch on the path in the
    repository, ``*`` crossing folders), in sorted order, fetching those the cache lacks.
    HubError: why there are none."""
    import fnmatch
    from pathlib import Path

    from huggingface_hub import snapshot_download

    try:
        root = Path(snapshot_download(repo, repo_type="dataset", revision=revision,
                                      allow_patterns=[pattern]))
    except Exception as exc:  # noqa: BLE001 - every hub failure, in one phrase
        raise HubError(_dataset_why(exc, repo, revision, pattern, copy_of=f"dataset {repo}",
                                    download=repo)) from None
    found = sorted(str(f) for f in root.rglob("*")
                   if f.is_file() and fnmatch.fnmatch(f.relative_to(root).as_posix(), pattern))
    if not found:
        raise HubError(f"no file of dataset {repo} matches {pattern!r}")
    return found


def _dataset_why(exc: Exception, repo: str, revision: str | None, path: str, *, copy_of: str,
                 download: str) -> str:
    """Why hub dataset ``repo``'s ``path`` could not be had, from huggingface_hub's error."""
    from huggingface_hub.errors import (EntryNotFoundError, GatedRepoError,
                                        LocalEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    if isinstance(exc, GatedRepoError):  # before its base, RepositoryNotFoundError
        return f"dataset {repo} is gated: accept its terms on its page and set HF_TOKEN"
    if isinstance(exc, RepositoryNotFoundError):
        return f"no dataset {repo} on the hub (a private one needs HF_TOKEN)"
    if isinstance(exc, RevisionNotFoundError):
        return f"dataset {repo} has no revision {revision!r}"
    if isinstance(exc, LocalEntryNotFoundError):  # before its base, EntryNotFoundError
        return (f"{_offline()} and the Hugging Face cache has no copy of {copy_of} (download "
                f"it once: 'hf download {download} --repo-type dataset')")
    if isinstance(exc, EntryNotFoundError):
        return f"dataset {repo} has no file {path!r}"
    return f"fetching it failed ({_first_line(exc)})"
