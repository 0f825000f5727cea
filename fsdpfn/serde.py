"""The one cattrs converter: YAML/JSON load and dump, dotted overrides, readable errors.

Errors are ConfigError with the dotted path, the rule and the value:
``optimizer.lr: must be > 0, got -1.0``.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any, TypeVar

import attrs
import cattrs
import yaml
from cattrs.errors import ClassValidationError, ForbiddenExtraKeysError, IterableValidationError

from fsdpfn.errors import ConfigError

__all__ = ["converter", "structure", "unstructure", "with_defaults", "to_yaml", "from_yaml",
           "to_json", "from_json", "apply_overrides", "load_config", "load_yaml", "load_json",
           "read_config_file"]

T = TypeVar("T")

class _NotAMapping(ConfigError):
    """A value where a mapping belongs; the message lacks the key, which the walk adds."""


converter = cattrs.Converter(forbid_extra_keys=True)
# tuples are written as lists in YAML/JSON; Optional[dict] (a transformers config) passes through
converter.register_structure_hook(dict, lambda value, _: _expect_dict(value))
# scalars pass through unchanged so that the attrs validators see (and name) the value as written,
# instead of cattrs coercing it (int(2.5) == 2, bool("false") is True)
for _scalar in (int, float, bool, str):
    converter.register_structure_hook(_scalar, lambda value, _: value)


def _expect_dict(value):
    if not isinstance(value, dict):
        raise _NotAMapping(f"must be a mapping, got {value!r}")
    return value


def _section_hook(cls):
    """A nested config (a section) must be a mapping: ``optimizer=5`` is named as such instead
    of failing inside cattrs (``argument of type 'int' is not iterable``)."""
    inner = converter.gen_structure_attrs_fromdict(cls)

    def structure_section(value, _):
        if not isinstance(value, dict):
            raise _NotAMapping(f"must be a mapping (section), got {value!r}")
        return inner(value, cls)
    return structure_section


converter.register_structure_hook_factory(attrs.has, _section_hook)


def _is_str_tuple(tp) -> bool:
    import typing

    return typing.get_origin(tp) is tuple and typing.get_args(tp) == (str, Ellipsis)


def _is_scalar_tuple(tp) -> bool:
    """A tuple of scalars other than names: ``tuple[float, float]``, ``tuple[int, ...]``."""
    import typing

    args = typing.get_args(tp)
    return (typing.get_origin(tp) is tuple and not _is_str_tuple(tp)
            and all(a in (int, float, bool, str, Ellipsis) for a in args))


# a tuple of scalars is passed on as written (a list stays a list, a scalar a scalar): the
# field's converter and validator name the rule (``betas: must be two numbers in [0, 1), got
# (0.9,)``), where cattrs would count the items in its own words ("Not enough values in [0.9]")
converter.register_structure_hook_func(_is_scalar_tuple, lambda value, _: value)


# a list of names written as one name (``target_modules: all-linear``, ``train_files: a.jsonl``)
# is that one name, never its characters; a value neither a name nor a list goes to the field's
# own converter and validator, which name the rule
converter.register_structure_hook_func(
    _is_str_tuple, lambda value, _: (value,) if isinstance(value, str)
    else tuple(value) if isinstance(value, (list, tuple)) else value)


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
        return _unknown_keys(leaf, path)
    msg = str(leaf)
    if isinstance(leaf, _NotAMapping):
        return ConfigError(f"{path or 'config'}: {msg}")
    if isinstance(leaf, ConfigError):
        # the leaf names its own field; prefix the path of the enclosing config, once (a
        # section's validator that names its section itself, ``data.prompt_key``, for configs
        # built outside fsdpfn.serde, gets only the path above it)
        head, _, last = path.rpartition(".")
        if path and msg.startswith(last + "."):
            return ConfigError(f"{head}.{msg}" if head else msg)
        return ConfigError(f"{path}.{msg}" if path else msg)
    return ConfigError(f"{path or 'config'}: {type(leaf).__name__}: {msg}")


def _unknown_keys(leaf: ForbiddenExtraKeysError, path: str) -> ConfigError:
    """An unknown key named with the closest valid one; a key that moved (a class's
    ``__fsdpfn_moved__``: {key: where it lives now}) is named with its new home."""
    keys = sorted(leaf.extra_fields)
    allowed = sorted(a.name for a in leaf.cl.__attrs_attrs__)
    moved = getattr(leaf.cl, "__fsdpfn_moved__", {})
    dotted = [f"{path}.{k}" if path else k for k in keys]
    for key, full in zip(keys, dotted):
        if key in moved:
            return ConfigError(f"{full}: not a key here, {moved[key]}")
    where = f"{path}: " if path else ""
    close = difflib.get_close_matches(keys[0], allowed, n=1, cutoff=0.6) if len(keys) == 1 \
        else []
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return ConfigError(f"{where}unknown key(s) {keys}{hint} (allowed: {allowed})")


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


def with_defaults(data: dict, defaults: dict, cls: type) -> dict:
    """``data`` written over ``defaults`` (an unstructured ``cls``): a section (a nested config
    class) written in part keeps the defaults of its other keys, at any depth; any other value
    written, a mapping field's included, replaces its default whole."""
    out = dict(defaults)
    sections = _sections(cls)
    for key, value in data.items():
        if key in sections and isinstance(value, dict) and isinstance(defaults.get(key), dict):
            out[key] = with_defaults(value, defaults[key], sections[key])
        else:
            out[key] = value
    return out


def _sections(cls: type) -> dict[str, type]:
    """Field name -> config class, for the fields of ``cls`` that are sections (optional ones
    included)."""
    import types
    import typing

    attrs.resolve_types(cls)
    out = {}
    for field in attrs.fields(cls):
        kinds = [field.type]
        if typing.get_origin(field.type) in (typing.Union, types.UnionType):
            kinds = [t for t in typing.get_args(field.type) if t is not type(None)]
        if len(kinds) == 1 and isinstance(kinds[0], type) and attrs.has(kinds[0]):
            out[field.name] = kinds[0]
    return out


def to_json(value: Any) -> str:
    return json.dumps(unstructure(value), indent=2, sort_keys=True)


def from_json(text: str, cls: type[T]) -> T:
    return structure(load_json(text), cls)


def to_yaml(value: Any) -> str:
    return yaml.safe_dump(unstructure(value), sort_keys=False)


def from_yaml(text: str, cls: type[T]) -> T:
    return structure(load_yaml(text) or {}, cls)


# ---------------------------------------------------------------- reading YAML and JSON text


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key written twice in one mapping (PyYAML keeps the last
    one silently; YAML itself requires keys to be unique)."""


def _construct_unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep=False):
    first: dict = {}  # key -> its first mark
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":  # '<<: *base' may be overridden
            continue
        key = loader.construct_object(key_node, deep=True)
        try:
            earlier = first.setdefault(key, key_node.start_mark)
        except TypeError:  # an unhashable key: SafeLoader's own error names it
            break
        if earlier is not key_node.start_mark:
            mark = key_node.start_mark
            written = key_node.value if isinstance(key_node, yaml.ScalarNode) else key
            read = f" (read as {key!r})" if written != key else ""  # on/yes/true are all True
            raise ConfigError(f"config: duplicate key {written!r}{read} at line {mark.line + 1}, "
                              f"column {mark.column + 1} (first at line {earlier.line + 1}, "
                              f"column {earlier.column + 1}): a key may appear once per mapping")
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
                                 _construct_unique_mapping)
# a date is read as the text written (YAML 1.2's core schema has no timestamps): a run_dir or a
# model directory named like a date is a path, and no config field holds a date
_UniqueKeyLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def load_yaml(text: str, *, what: str = "config") -> Any:
    """Parse YAML text (safe types only). A syntax error or a repeated key is a ConfigError of
    one line that gives the line and column: ``config: YAML syntax error at line 3, column 5:
    mapping values are not allowed here``."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except ConfigError as exc:
        raise ConfigError(str(exc).replace("config:", f"{what}:", 1)) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = exc.problem or exc.context or "invalid YAML"
        if exc.context and exc.problem and exc.context_mark:
            problem += f" ({exc.context} at line {exc.context_mark.line + 1})"
        raise ConfigError(f"{what}: YAML syntax error{where}: {_one_line(problem)}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{what}: YAML error: {_one_line(exc)}") from None


def _unique_pairs(pairs: list) -> dict:
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise ConfigError(f"config: duplicate key {key!r}: a key may appear once per "
                              f"object")
        out[key] = value
    return out


def load_json(text: str) -> Any:
    """Parse JSON text; syntax errors and repeated keys are one-line ConfigErrors."""
    try:
        return json.loads(text, object_pairs_hook=_unique_pairs)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"config: JSON syntax error at line {exc.lineno}, column {exc.colno}: "
                          f"{exc.msg}") from None


def read_config_file(path: str | Path) -> Any:
    """The plain data of a YAML or JSON (by suffix) config file; ConfigError when it is missing,
    unreadable or not valid YAML/JSON (the message gives the file, line and column)."""
    path = Path(path)
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise ConfigError(f"config: file {what}, got {str(path)!r}")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config: cannot read {str(path)!r}: {_one_line(exc)}") from None
    try:
        return load_json(text) if path.suffix == ".json" else load_yaml(text)
    except ConfigError as exc:
        raise ConfigError(str(exc).replace("config:", f"config {str(path)!r}:", 1)) from None


# ---------------------------------------------------------------- overrides and files


def _check_plain(value: Any, path: str) -> None:
    """ConfigError naming the first value that is not plain data (strings, numbers, bools,
    null, lists, mappings): what an explicit YAML tag makes (!!binary, !!set, !!timestamp)."""
    if isinstance(value, dict):
        for key, item in value.items():
            _check_plain(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_plain(item, f"{path}[{i}]")
    elif not isinstance(value, (str, int, float, bool, type(None))):
        raise ConfigError(f"{path or 'config'}: must be a string, number, bool, null, list or "
                          f"mapping, got {type(value).__name__} {_one_line(repr(value))[:80]}")


def apply_overrides(data: dict, overrides: list[str] | tuple[str, ...]) -> dict:
    """Return a copy of ``data`` with dotted ``key.sub=value`` overrides (values parsed as YAML)."""
    _check_plain(data, "")
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
        value = load_yaml(raw, what=f"override {item!r}")
        _check_plain(value, ".".join(parts))
        node[parts[-1]] = value
    return out


def load_config(path: str | Path, cls: type[T], overrides: list[str] | tuple[str, ...] = ()) -> T:
    """Read a YAML or JSON file, apply dotted overrides, and structure it as ``cls``."""
    data = read_config_file(path) or {}
    return structure(apply_overrides(data, overrides), cls)
