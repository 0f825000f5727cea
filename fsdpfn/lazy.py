"""A package's exports imported on first use (PEP 562), for its ``__init__``::

    __getattr__, __dir__ = lazy_exports(__name__, {"name": "package.module", ...}, __all__)

``import package`` then runs none of its modules: ``fsdpfn`` imports no torch, the launcher reads
``fsdpfn.checkpoint.files`` and starts servers through ``fsdpfn.rollout.process`` without the
engine. ``submodules`` are names of the package's own modules, imported on first use too.
"""

from __future__ import annotations

import importlib
import sys
from typing import Callable, Iterable


def lazy_exports(package: str, sources: dict[str, str], names: Iterable[str],
                 submodules: Iterable[str] = ()) -> tuple[Callable, Callable]:
    """The ``__getattr__`` and ``__dir__`` of ``package``: ``sources`` maps each exported name
    to the module that defines it; ``names`` (``__all__``) are listed by ``dir()``."""
    submodules, names = frozenset(submodules), list(names)

    def __getattr__(name: str):
        if name in sources:
            value = getattr(importlib.import_module(sources[name]), name)
        elif name in submodules:
            value = importlib.import_module(f"{package}.{name}")
        else:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        setattr(sys.modules[package], name, value)  # later lookups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(names))

    return __getattr__, __dir__
