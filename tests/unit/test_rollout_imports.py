"""The layout rules of the weights wing (docs/architecture.md), read from the source with ast:
the rollout server needs nothing of the trainer (it imports fsdpfn.wire, its own modules and the
leaf helpers errors, ports, supervise), fsdpfn.wire imports nothing of either end, and no module
of fsdpfn.rollout but the engine's own touches the engine's private fields (its weights change
only through RolloutEngine.swap)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "fsdpfn"
LEAVES = {"fsdpfn.errors", "fsdpfn.ports", "fsdpfn.supervise"}


def _imports(path: Path) -> set[str]:
    """The fsdpfn modules ``path`` imports (absolute names; relative imports resolved)."""
    package = "fsdpfn." + ".".join(path.relative_to(ROOT).parent.parts)
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            out |= {module} | {f"{module}.{a.name}" for a in node.names
                               if module == "fsdpfn" or module.count(".") < 1}
    return {m for m in out if m == "fsdpfn" or m.startswith("fsdpfn.")}


def _allowed(module: str, own: tuple[str, ...]) -> bool:
    return module in LEAVES or any(module == o or module.startswith(o + ".") for o in own)


@pytest.mark.parametrize("package,own", [
    ("rollout", ("fsdpfn.rollout", "fsdpfn.wire")),
    ("wire", ("fsdpfn.wire",)),
])
def test_the_server_and_the_wire_import_nothing_of_the_trainer(package, own):
    wrong = {f"{path.name}: {m}" for path in sorted((ROOT / package).glob("*.py"))
             for m in _imports(path) if not _allowed(m, own)}
    assert not wrong, sorted(wrong)


def test_only_the_engine_touches_its_private_fields():
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
