"""The one table printer of the benchmark scripts: rows of dicts as a Markdown table."""

from __future__ import annotations


def print_markdown_table(rows: list[dict], first: tuple[str, ...]) -> None:
    """Columns: ``first`` then every other key in order of first appearance; blanks where a row
    lacks a key."""
    keys = list(first)
    for row in rows:
        keys += [k for k in row if k not in keys]
    print("\n| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(str(row.get(k, "")) for k in keys) + " |")
