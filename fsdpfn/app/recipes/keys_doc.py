"""docs/recipes.md, generated from the recipe config classes so that it cannot drift.

    python -m fsdpfn.app.recipes.keys_doc            # print the page
    python -m fsdpfn.app.recipes.keys_doc --write    # rewrite docs/recipes.md

Every recipe, and every YAML key of every section, is read from the classes themselves
(``RECIPE_CONFIGS`` and the sections they compose: names, nesting, defaults, and the rule each
validator enforces, read from the validator). A key's description is, in order: the comment
written above its field, the first sentence of its class docstring that names it (````key````),
or ``NOTES`` of fsdpfn.app.recipes.keys_notes (the page's hand-written text, with the section
titles and refusals the classes do not carry). ``tests/unit/test_recipes_doc.py`` fails when
the committed page differs from this output, or when a key has no description.
"""

from __future__ import annotations

import inspect
import re
import sys
import typing
from pathlib import Path

import attrs

from fsdpfn import serde
from fsdpfn.config import EngineConfig
from fsdpfn.errors import ConfigError
from fsdpfn.app.recipes import NEEDS_ROLLOUT, RECIPE_CONFIGS
from fsdpfn.app.recipes.engine import MOVED, OWNED, EngineSection
from fsdpfn.app.recipes.keys_notes import NOTES, REFUSED_IN, RULES, SECTION_TITLES
from fsdpfn.app.recipes.model_defaults import model_defaults

__all__ = ["render", "undescribed", "PAGE"]

PAGE = Path(__file__).resolve().parents[3] / "docs" / "recipes.md"


# ---------------------------------------------------------------- reading the classes


def _source_class(cls):
    """The class whose source holds ``cls``'s field definitions (EngineSection is generated
    from EngineConfig)."""
    return EngineConfig if cls is EngineSection else cls


def _doc(cls) -> str:
    return inspect.cleandoc(_source_class(cls).__doc__ or "")


def _comments(cls) -> dict[str, str]:
    """{field: the comment lines written right above its definition}."""
    lines = inspect.getsource(_source_class(cls)).splitlines()
    out, pending = {}, []
    for line in lines:
        s = line.strip()
        if s.startswith("#"):
            pending.append(s.lstrip("#").strip())
            continue
        m = re.match(r"(\w+)\s*:\s*[^=]+=\s*attrs\.field", s)
        if m and pending:
            out[m.group(1)] = " ".join(pending)
        pending = []
    return out


def _sentences(text: str) -> list[str]:
    flat = " ".join(text.split())
    return [s for s in re.split(r"(?<=[.])\s+(?=[A-Z`(\"'])", flat) if s]


def _from_docstring(cls, name: str) -> str | None:
    """The docstring sentence that starts with ````name````."""
    for s in _sentences(_doc(cls)):
        if re.match(rf"``{re.escape(name)}(``|[=:> ])", s):
            return s.rstrip(".")
    return None


def describe(cls, name: str) -> str | None:
    if cls in RECIPE_CONFIGS.values():  # a recipe's docstring describes the loop, not its keys
        return NOTES.get((cls.__name__, name)) or NOTES.get(("*", name))
    return (_comments(cls).get(name) or _from_docstring(cls, name)
            or NOTES.get((cls.__name__, name)) or NOTES.get(("*", name)))


_PROBES = (object(), None, True, "", -10**9, 10**9, -1.5, 0, 0.5, 1, 1e300, -1e300,
           float("nan"), (), ("",), ("a", "b"))


def _rule(attribute) -> str:
    """What the field accepts, in the validator's own words: each probe value the validator
    refuses gives its rule (``lr: must be > 0, got -1.5`` -> ``> 0``), so the page follows the
    validators whatever their implementation."""
    rules: list[str] = []
    null_ok = False
    for probe in _PROBES:
        try:
            attribute.validator(None, attribute, probe) if attribute.validator else None
        except ConfigError as exc:
            m = re.search(r": (?:must be )?(.*?), got ", str(exc), re.S)
            if m and m.group(1) not in rules:
                rules.append(m.group(1))
            continue
        except Exception:  # a validator that reads other fields of the instance
            continue
        if probe is None and attribute.validator is not None:
            null_ok = True
    text = "; ".join(" ".join(r.split()) for r in rules)
    return text + ("; or null" if text and null_ok else "")


def _type(attribute) -> str:
    tp = attribute.type
    text = tp if isinstance(tp, str) else getattr(tp, "__name__", None) or str(tp)
    return str(text).replace("typing.", "").replace("NoneType", "None")


def _value(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_value(x)}" for k, x in v.items()) + "}"
    return str(v)


def _default(attribute, owner=None):
    """A field's default; one computed from the instance (a recipe's ``DEFAULTS``) is read
    from ``owner()``."""
    d = attribute.default
    if isinstance(d, attrs.Factory):
        d = getattr(owner(), attribute.name) if d.takes_self else d.factory()
    return d


def _section_class(attribute):
    """The attrs class a field holds (LoRAConfig for ``LoRAConfig | None``), else None."""
    tp = attribute.type
    if attrs.has(tp):
        return tp
    for arg in typing.get_args(tp):
        if isinstance(arg, type) and attrs.has(arg):
            return arg
    return None


def _fields(cls):
    attrs.resolve_types(cls)
    return attrs.fields(cls)


def _sections(cls, prefix: str = "") -> list[tuple[str, type]]:
    """[(dotted path, class)] of every section under ``cls``, depth first."""
    out = []
    for a in _fields(cls):
        sub = _section_class(a)
        if sub is not None:
            path = f"{prefix}{a.name}"
            out.append((path, sub))
            out.extend(_sections(sub, path + "."))
    return out


def undescribed() -> list[str]:
    """Every ``Class.key`` the page would show without a description."""
    missing = []
    for cls in _all_classes():
        for a in _fields(cls):
            if describe(cls, a.name) is None and _section_class(a) is None:
                missing.append(f"{cls.__name__}.{a.name}")
    return missing


def _all_classes() -> list[type]:
    seen: list[type] = []
    for rc in RECIPE_CONFIGS.values():
        for cls in (rc, *(c for _, c in _sections(rc))):
            if cls not in seen:
                seen.append(cls)
    return seen


# ---------------------------------------------------------------- the page


def _anchor(title: str) -> str:
    return re.sub(r"[^a-z0-9 _-]", "", title.lower()).replace(" ", "-")


def _table(cls, path: str, section_titles: dict[type, str]) -> list[str]:
    rows = ["| key | default | accepts | what it does |", "|---|---|---|---|"]
    for a in _fields(cls):
        key = f"`{path}.{a.name}`" if path else f"`{a.name}`"
        sub = _section_class(a)
        if sub is not None and a.default is not None:
            title = section_titles[sub]
            rows.append(f"| {key} | (section) | see [{title}](#{_anchor(title)}) | "
                        f"{_cell(describe(cls, a.name) or '')} |")
            continue
        accepts = _rule(a) or _type(a)
        if sub is not None:
            title = section_titles[sub]
            accepts = f"null, or the keys of [{title}](#{_anchor(title)})"
        default = _value(serde.unstructure(_default(a, cls)))
        rows.append(f"| {key} | `{default}` | {_cell(accepts)} | "
                    f"{_cell(describe(cls, a.name) or '')} |")
    return rows


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _recipe_overrides(name: str, cls) -> list[tuple[str, object, object]]:
    """(dotted key, class default, this recipe's default) where the recipe sets its own."""
    out = []

    def walk(section_cls, value, path):
        for a in _fields(section_cls):
            sub = _section_class(a)
            v = getattr(value, a.name)
            p = f"{path}{a.name}"
            if sub is not None and v is not None and section_cls is not cls:
                walk(sub, v, p + ".")
            elif sub is not None and v is not None:
                walk(sub, v, p + ".")
            elif section_cls is not cls:
                base = _default(a, section_cls)
                if serde.unstructure(v) != serde.unstructure(base):
                    out.append((p, base, v))
    walk(cls, cls(), "")
    return out


def render() -> str:
    classes = _all_classes()
    section_titles: dict[type, str] = {}
    paths: dict[type, list[str]] = {}
    for rc in RECIPE_CONFIGS.values():
        for path, sub in _sections(rc):
            paths.setdefault(sub, [])
            if path not in paths[sub]:
                paths[sub].append(path)
    for sub, ps in paths.items():
        ps.sort(key=lambda p: (p.count("."), len(p), p))  # the plainest key names the section
        section_titles[sub] = SECTION_TITLES.get(ps[0], f"{ps[0]}: {sub.__name__}")

    out = ["# Recipes and every YAML key", "",
           "<!-- Generated by `python -m fsdpfn.app.recipes.keys_doc --write` from the config "
           "classes; tests/unit/test_recipes_doc.py fails when this page differs. Edit the "
           "classes (or NOTES in fsdpfn/app/recipes/keys_notes.py), not this page. -->", "",
           "`fsdpfn run FILE.yaml` runs one recipe. The file names it (`recipe: grpo`) and sets "
           "any of the keys below; every key not written keeps its default. A misspelt key is "
           "refused with the closest valid one, a key of another recipe with the recipes "
           "that have it (a step's size with this recipe's own key: `batch_size` in sft, "
           "`prompts_per_step` in grpo and ppo, `pairs_per_step` in rw and dpo), a bad value "
           "with the dotted key, the rule and "
           "the value, in one line (exit status 2); a run refused before its ranks start (the "
           "config's and the data's checks) leaves no run_dir it would have made, nor a "
           "half-written `run_dir/data`. `fsdpfn config NAME` prints a "
           "recipe's full default config as YAML, "
           "`fsdpfn config FILE.yaml` a file resolved, and every run writes what it ran to "
           "`run_dir/config.yaml`. Overrides go on the command line as dotted keys: "
           "`fsdpfn run FILE.yaml steps=40 engine.fsdp.offload_params=true`.", "",
           "## The recipes", "",
           "| recipe | config class | models built | rollout server | what it runs |",
           "|---|---|---|---|---|"]
    for name, rc in RECIPE_CONFIGS.items():
        keys = {a.name for a in _fields(rc)}
        models = ["policy (`engine:`)"]
        if "ref_engine" in keys:
            models.append("reference (`ref_engine:`)")
        if "critic_engine" in keys:
            models.append("critic (`critic_engine:`)")
        out.append(f"| `{name}` | `{rc.__name__}` | {', '.join(models)} | "
                   f"{'yes' if name in NEEDS_ROLLOUT else 'no'} | "
                   f"{_cell(' '.join(_doc(rc).split()))} |")
    out += ["", "## Each recipe's top-level keys and its own defaults", "",
            "A section's keys and their class defaults are in the [sections](#the-sections) "
            "below; the table after each recipe lists the defaults that recipe sets "
            "differently.", ""]
    for name, rc in RECIPE_CONFIGS.items():
        out += [f"### {name}", ""]
        out += _table(rc, "", section_titles)
        own = _recipe_overrides(name, rc)
        if own:
            out += ["", f"Defaults `{name}` sets differently from the section's class:", "",
                    "| key | class default | in this recipe |", "|---|---|---|"]
            out += [f"| `{k}` | `{_value(serde.unstructure(b))}` | "
                    f"`{_value(serde.unstructure(v))}` |" for k, b, v in own]
        out += ["", "With a pretrained model of your own (`model.path` without "
                    "`model.random_init`), keys the file or an override leaves unset default "
                    "to these instead (with `engine.lora`, the policy's learning rates are ten "
                    "times those of the full model; `fsdpfn run` and `fsdpfn config` name "
                    "the ones a config takes in one line, `model.path names a pretrained "
                    "model: ...`):", "",
                "| key | with `model.path` | with `model.path` and `engine.lora` |",
                "|---|---|---|"]
        full = model_defaults(name, {"model": {"path": "DIR"}})
        lora = model_defaults(name, {"model": {"path": "DIR"}, "engine": {"lora": {}}})
        no_lora = name in REFUSED_IN.get("LoRAConfig", ())
        out += [f"| `{k}` | `{_value(v)}` | "
                f"{'(refused in this recipe)' if no_lora else f'`{_value(lora[k])}`'} |"
                for k, v in full.items()]
        if RULES.get(name):
            out += ["", f"Rules `{name}` adds to the sections' own (each refused before "
                        f"launch, in one line):", ""]
            out += [f"- {rule}" for rule in RULES[name]]
        out.append("")
    out += ["## The sections", "",
            "Each section is a frozen attrs class; a YAML mapping under its key sets its "
            "fields.", ""]
    for sub in classes:
        if sub in RECIPE_CONFIGS.values():
            continue
        title = section_titles[sub]
        ps = paths[sub]
        out += [f"### {title}", ""]
        where = ", ".join(f"`{p}:`" for p in ps)
        used = sorted(n for n, rc in RECIPE_CONFIGS.items()
                      if any(c is sub for _, c in _sections(rc))
                      and n not in REFUSED_IN.get(sub.__name__, ()))
        out += [f"Key{'s' if len(ps) > 1 else ''}: {where} (recipes: {', '.join(used)}). "
                f"Class: `{sub.__module__}.{sub.__name__}`.", ""]
        if sub is EngineSection:
            out += ["Every `fsdpfn.EngineConfig` field under the same name, less those the "
                    "recipe sets itself. `ref_engine:` and `critic_engine:` take the same keys "
                    "as overrides of this section (each key not written there is the policy's; "
                    "neither inherits `lora`).", "",
                    "| EngineConfig field | set in the YAML by |", "|---|---|"]
            out += [f"| `{k}` | {_cell(v)} |" for k, v in OWNED.items()]
            out += ["", "Keys that moved into `engine:` (the old top-level key is refused with "
                    "a pointer): " + ", ".join(f"`{k}` -> `{v}`" for k, v in MOVED.items())
                    + ".", ""]
        doc = _doc(sub)
        if doc and sub is not EngineSection:
            out += [" ".join(p.split()) for p in doc.split("\n\n")]
            out = _blank_between(out, len(out) - len(doc.split("\n\n")))
            out.append("")
        out += _table(sub, ps[0], section_titles)
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def _blank_between(lines: list[str], start: int) -> list[str]:
    head, paras = lines[:start], lines[start:]
    out = list(head)
    for i, p in enumerate(paras):
        if i:
            out.append("")
        out.append(p)
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    text = render()
    if "--write" in argv:
        PAGE.write_text(text)
        print(f"wrote {PAGE}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
