"""The README's test command is the one CI runs, and its main command names a real entry point."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    return [line.strip() for block in blocks[:2] for line in block.strip().splitlines()]


def test_ci_runs_the_readme_test_command():
    main_cmd, test_cmd = _readme_commands()[:2]
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_cmd in ci.splitlines(), (test_cmd, ci)
    assert "pip install -q torch==2.13.0" in test_cmd and "pytest" in test_cmd
    assert "pip install -q torch==2.13.0" in main_cmd and "fsdpfn demo" in main_cmd


# ---------------------------------------------------------------- the docs the README points to
# (every YAML and Python block of the README and docs/ runs in tests/unit/test_docs_snippets.py)

import attrs  # noqa: E402

DOC_PAGES = ("getting-started.md", "recipes.md", "api.md", "parallelism.md", "rollout.md",
             "troubleshooting.md", "models.md", "observability.md", "architecture.md",
             "README.md")


def test_readme_links_every_docs_page_and_each_exists():
    readme = (ROOT / "README.md").read_text()
    index = (ROOT / "docs" / "README.md").read_text()
    for page in DOC_PAGES:
        assert (ROOT / "docs" / page).is_file(), page
        assert f"](docs/{page})" in readme, f"the README does not link docs/{page}"
        if page != "README.md":
            assert f"]({page})" in index, f"docs/README.md does not link {page}"


def test_readme_figures_link_their_benchmarks_sections():
    """Each figure's section link names a heading of BENCHMARKS.md."""
    readme = (ROOT / "README.md").read_text()
    bench = (ROOT / "BENCHMARKS.md").read_text()
    anchors = {re.sub(r"[^a-z0-9 _-]", "", h.lower()).replace(" ", "-")
               for h in re.findall(r"^#+ (.+)$", bench, flags=re.M)}
    links = re.findall(r"\]\(BENCHMARKS\.md#([^)]+)\)", readme)
    assert links, "the README's figures link their BENCHMARKS.md sections"
    missing = [a for a in links if a not in anchors]
    assert not missing, f"no BENCHMARKS.md section for {missing}"


def test_readme_names_exist():
    """The public names the README's text and table use are real."""
    import fsdpfn as ff

    readme = (ROOT / "README.md").read_text()
    for name in re.findall(r"`ff\.(\w+)", readme):
        assert hasattr(ff, name), name


def test_api_page_is_linked_and_names_the_public_surface():
    import fsdpfn as ff

    text = (ROOT / "docs" / "api.md").read_text()
    assert "](docs/api.md)" in (ROOT / "README.md").read_text()
    assert text.startswith("# fsdpfn public API contract")
    missing = [name for name in ff.__all__
               if f"`{name}" not in text and f"fsdpfn.{name}" not in text]
    assert not missing, f"docs/api.md does not name {missing}"
    fields = [a.name for a in attrs.fields(ff.EngineConfig)]
    missing = [f for f in fields if f"`{f}`" not in text]
    assert not missing, f"docs/api.md's EngineConfig table lacks {missing}"
