"""The one cattrs converter: YAML/JSON load and dump, dotted overrides, readable errors.

Errors are ConfigError with the dotted path, the rule and the value:
``optimizer.lr: must be > 0, got -1.0``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TypeVar

import cattrs
import yaml
from cattrs.errors import ClassValidationError, ForbiddenExtraKeysError, IterableValidationError

from fsdpfn.errors import ConfigError

__all__ = ["converter", "structure", "unstructure", "to_yaml", "from_yaml", "to_json", "from_json",
           "apply_overrides", "load_config"]

T = TypeVar("T")

converter = cattrs.Converter(forbid_extra_keys=True)
# tuples are written as lists in YAML/JSON; Optional[dict] (a transformers config) passes through
converter.register_structure_hook(dict, lambda value, _: _expect_dict(value))
# scalars pass through unchanged so that the attrs validators see (and name) the value as written,
# instead of cattrs coercing it (int(2.5) == 2, bool("false") is True)
for _scalar in (int, float, bool, str):
    converter.register_structure_hook(_scalar, lambda value, _: value)


def _expect_dict(value):
    if not isinstance(value, dict):
        raise ConfigError(f"must be a mapping, got {value!r}")
    return value


def _first_error(exc: BaseException, path: str) -> tuple[str, BaseException]:
    """Walk cattrs' exception groups down to the first leaf, building the dotted path."""
    if isinstance(exc, ForbiddenExtraKeysError):
        return path, exc
    if isinstance(exc, (ClassValidationError, IterableValidationError)):
        for sub in exc.exceptions:
            note = next((n for n in getattr(sub, "__notes__", ()) if "@ attribute" in str(n)
                         or "@ index" in str(n)), None)
            name = getattr(note, "name", None)
            index = getattr(note, "index", None)
            if name is not None:
                sub_path = f"{path}.{name}" if path else name
            elif index is not None:
                sub_path = f"{path}[{index}]"
            else:
                sub_path = path
            return _first_error(sub, sub_path)
    return path, exc


def _config_error(exc: BaseException, root: str = "") -> ConfigError:
    path, leaf = _first_error(exc, root)
    if isinstance(leaf, ForbiddenExtraKeysError):
        keys = sorted(leaf.extra_fields)
        where = f"{path}: " if path else ""
        return ConfigError(f"{where}unknown key(s) {keys} (allowed: "
                           f"{sorted(a.name for a in leaf.cl.__attrs_attrs__)})")
    msg = str(leaf)
    if isinstance(leaf, ConfigError):
        # the leaf names its own field; prefix the path of the enclosing config
        return ConfigError(f"{path}.{msg}" if path else msg)
    return ConfigError(f"{path or 'config'}: {type(leaf).__name__}: {msg}")


def structure(data: Any, cls: type[T]) -> T:
    """Build a config of type ``cls`` from plain data; ConfigError names path, rule and value."""
    if not isinstance(data, dict):
        raise ConfigError(f"{cls.__name__}: must be a mapping, got {data!r}")
    try:
        return converter.structure(data, cls)
    except ConfigError:
        raise
    except (ClassValidationError, IterableValidationError, ForbiddenExtraKeysError) as exc:
        raise _config_error(exc) from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{cls.__name__}: {exc}") from None


def unstructure(value: Any) -> Any:
    return converter.unstructure(value)


def to_json(value: Any) -> str:
    return json.dumps(unstructure(value), indent=2, sort_keys=True)


def from_json(text: str, cls: type[T]) -> T:
    return structure(json.loads(text), cls)


def to_yaml(value: Any) -> str:
    return yaml.safe_dump(unstructure(value), sort_keys=False)


def from_yaml(text: str, cls: type[T]) -> T:
    return structure(yaml.safe_load(text) or {}, cls)


def apply_overrides(data: dict, overrides: list[str] | tuple[str, ...]) -> dict:
    """Return a copy of ``data`` with dotted ``key.sub=value`` overrides (values parsed as YAML)."""
    out = json.loads(json.dumps(data))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override: must look like 'key.sub=value', got {item!r}")
        dotted, raw = item.split("=", 1)
        parts = [p for p in dotted.strip().split(".")]
        if not all(parts):
            raise ConfigError(f"override: empty key segment in {dotted!r}")
        node = out
        for depth, part in enumerate(parts[:-1]):
            child = node.get(part) if isinstance(node, dict) else None
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override: {'.'.join(parts[:depth + 1])} is not a mapping, "
                                  f"got {child!r}")
            node = child
        node[parts[-1]] = yaml.safe_load(raw)
    return out


def load_config(path: str | Path, cls: type[T], overrides: list[str] | tuple[str, ...] = ()) -> T:
    """Read a YAML or JSON file, apply dotted overrides, and structure it as ``cls``."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config: file does not exist, got {str(path)!r}")
    text = path.read_text()
    data = json.loads(text) if path.suffix == ".json" else (yaml.safe_load(text) or {})
    return structure(apply_overrides(data, overrides), cls)
