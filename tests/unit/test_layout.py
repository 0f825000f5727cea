"""The package's layout rules (docs/architecture.md, "Layers"), read from the source with ast.

Every module of fsdpfn belongs to one package; a package imports only the packages below it:

    contract   config, errors, keys, lazy, serde, validators, ops/  (imports: errors; ops/ also
               validators, a leaf of rules)
    agree      every rank agreeing on one verdict              (imports: errors)
    wire/      what both ends of the push speak                (imports: errors)
    batch/     the batch format                                (contract, agree)
    engine/    mesh, state, forward, step                      (contract, agree, batch, wire)
    algos/     one file per algorithm                          (engine and below)
    checkpoint/, weights/   the trainer's wings                (engine and below)
    rollout/   the built-in server and its clients             (errors, lazy, wire: nothing of the
                                                               trainer)
    app/       cli, launcher, supervision, recipes             (anything)
    testing/   helpers for tests                               (anything but app)

``from fsdpfn import name`` counts as an import of the module that defines ``name`` (the lazy
export table of fsdpfn/__init__.py).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import fsdpfn

ROOT = Path(__file__).resolve().parents[2] / "fsdpfn"
CONTRACT = {"config", "errors", "keys", "lazy", "serde", "validators", "ops"}
BELOW = {
    "errors": set(), "keys": set(), "lazy": set(), "validators": {"errors"},
    "config": {"errors", "validators"},
    "serde": {"errors"}, "ops": {"errors", "validators"},
    "agree": {"errors"}, "wire": {"errors"},
    "batch": CONTRACT | {"agree"},
    "engine": CONTRACT | {"agree", "batch", "wire"},
}
BELOW["algos"] = BELOW["engine"] | {"engine"}
BELOW["checkpoint"] = BELOW["engine"] | {"engine"}
BELOW["weights"] = BELOW["engine"] | {"engine"}
BELOW["rollout"] = {"errors", "lazy", "wire"}
PACKAGES = sorted(BELOW)


def _package(path: Path) -> str:
    return path.relative_to(ROOT).parts[0].removesuffix(".py")


def _target(module: str, name: str | None) -> str | None:
    """The fsdpfn package an import reaches (None: not fsdpfn's)."""
    if module == "fsdpfn" and name is not None:
        source = fsdpfn._SOURCES.get(name)
        module = source if source else f"fsdpfn.{name}"
    if module == "fsdpfn":
        return "fsdpfn"
    if not module.startswith("fsdpfn."):
        return None
    return module.split(".")[1]


def _imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, _target(a.name, None)) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out += [(node.lineno, _target(node.module, a.name)) for a in node.names]
    return [(line, t) for line, t in out if t is not None and t not in ("__version__",)]


def _modules() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py") if p.parent != ROOT or p.stem not in
                  ("__init__", "__main__"))


def test_every_module_belongs_to_a_known_package():
    known = set(BELOW) | {"app", "testing"}
    stray = sorted(str(p.relative_to(ROOT)) for p in _modules() if _package(p) not in known)
    assert not stray, f"modules outside the layout of docs/architecture.md: {stray}"


@pytest.mark.parametrize("package", PACKAGES)
def test_a_package_imports_only_what_lies_below_it(package):
    allowed = BELOW[package] | {package}
    wrong = [f"{p.relative_to(ROOT)}:{line}: imports fsdpfn.{t}"
             for p in _modules() if _package(p) == package
             for line, t in _imports(p) if t not in allowed]
    assert not wrong, wrong


def test_nothing_below_the_application_imports_it():
    wrong = [f"{p.relative_to(ROOT)}:{line}" for p in _modules() if _package(p) != "app"
             for line, t in _imports(p) if t == "app"]
    assert not wrong, wrong


def test_the_rules_can_fail(tmp_path):
    """The checker sees a forbidden import when there is one: a direct one, and one through the
    lazy export table."""
    probe = tmp_path / "probe.py"
    probe.write_text("from fsdpfn.engine.state import EngineState\nfrom fsdpfn import shard_model\n"
                     "import fsdpfn.wire.http\nimport json\n")
    assert [t for _, t in _imports(probe)] == ["engine", "engine", "wire"]
    assert "engine" not in BELOW["rollout"]


def test_only_the_served_engine_touches_its_private_fields():
    """No module of fsdpfn.rollout but engine.py reaches into RolloutEngine's private fields: its
    weights change only through RolloutEngine.swap."""
    wrong = []
    for path in sorted((ROOT / "rollout").glob("*.py")):
        if path.name == "engine.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") \
                    and not node.attr.startswith("__"):
                owner = node.value
                name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", "")
                if name == "engine":
                    wrong.append(f"{path.name}:{node.lineno}: engine.{node.attr}")
    assert not wrong, wrong


def test_no_module_is_over_500_lines():
    """docs/architecture.md's rule: a module that grows past 500 lines holds more than one
    concern, and is cut by concern (each part owning its state) before it lands."""
    long = {str(p.relative_to(ROOT)): n for p in ROOT.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 500}
    assert not long, long


def test_every_directory_of_modules_is_a_package():
    """pyproject's ``packages.find`` ships regular packages only: a directory of modules
    without an __init__.py imports from a checkout (an editable install) and is missing from
    the wheel. A wheel built at 631525c held every tracked file of fsdpfn/ (152)."""
    missing = sorted(str(d.relative_to(ROOT.parent)) for d in {p.parent for p in
                                                                ROOT.rglob("*.py")}
                     if not (d / "__init__.py").is_file())
    assert not missing, missing
