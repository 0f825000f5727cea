"""Reading a recipe's data files: fsdpfn's reader against the `datasets` package's loaders.

    python benchmarks/data_read.py                 # 200,000 rows (default)
    python benchmarks/data_read.py --rows 1000000

The recipes read data files with fsdpfn.app.recipes.data_rows (JSON with the standard library,
Parquet with pyarrow), then check every value a recipe reads. This compares that path with
`datasets.load_dataset` on the same files (first load: Arrow cache written; second: cache hit)
and prints what each makes of two flawed files: a line cut short, and an answer column that
mixes strings and numbers (``"007"`` and ``12``). Rows: prompt (a sentence of a few
dozen words) and answer (a short string), as a math RL set has them. Each time is the median of
3 runs in a fresh process, import of the reading package included (what `fsdpfn run` pays),
and the import's own share beside it (fsdpfn's imports torch).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _table import print_markdown_table  # noqa: E402

FSDPFN = """
import sys, time
t0 = time.perf_counter()
from fsdpfn.app.recipes.data_rows import read_rows, check_rows
t1 = time.perf_counter()
rows = read_rows(tuple(sys.argv[1:]), "train_files")
check_rows(rows, {"prompt": "prompt", "answer": "answer"}, "grpo")
print(len(rows.rows), time.perf_counter() - t0, t1 - t0)
"""

DATASETS = """
import sys, time
t0 = time.perf_counter()
import datasets
datasets.disable_progress_bars()
t1 = time.perf_counter()
kind = "parquet" if sys.argv[2].endswith(".parquet") else "json"
ds = datasets.load_dataset(kind, data_files=sys.argv[2:], split="train", cache_dir=sys.argv[1])
rows = ds.to_list()
print(len(rows), time.perf_counter() - t0, t1 - t0)
"""


def run(code: str, *args: str) -> tuple[int, float, str, float]:
    """(rows, seconds, stderr's last line, seconds of the import) of ``code`` in a fresh
    interpreter."""
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [x for x in proc.stderr.strip().splitlines() if x.strip()]
        return -1, float("nan"), lines[-1] if lines else f"rc={proc.returncode}", float("nan")
    n, seconds, imported = proc.stdout.split()
    return int(n), float(seconds), "", float(imported)


def write_files(root: str, n: int) -> dict[str, str]:
    rng = random.Random(0)
    words = ["what", "is", "the", "sum", "of", "seven", "and", "twelve", "apples", "per",
             "basket", "if", "each", "holds", "more", "than", "before", "answer", "with"]
    rows = [{"prompt": " ".join(rng.choice(words) for _ in range(rng.randint(20, 60))),
             "answer": str(rng.randint(0, 10_000))} for _ in range(n)]
    paths = {"jsonl": os.path.join(root, "train.jsonl"),
             "parquet": os.path.join(root, "train.parquet"),
             "bad": os.path.join(root, "bad.jsonl")}
    with open(paths["jsonl"], "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.Table.from_pylist(rows), paths["parquet"])
    with open(paths["bad"], "w") as f:  # line 7 cut short, as an interrupted export leaves it
        lines = [json.dumps(r) for r in rows[:1000]]
        lines[6] = lines[6][:25]
        f.writelines(x + "\n" for x in lines)
    paths["mixed"] = os.path.join(root, "mixed.jsonl")
    with open(paths["mixed"], "w") as f:
        f.writelines(json.dumps({"prompt": p, "answer": a}) + "\n"
                     for p, a in (("p0", "007"), ("p1", 12), ("p2", "1/2")))
    return paths


FIRST_ANSWERS = {  # the answer column as each reader returns it
    "fsdpfn": "from fsdpfn.app.recipes.data_rows import read_rows; import sys; "
              "print([r['answer'] for r in read_rows((sys.argv[1],), 'train_files').rows])",
    "datasets": "import datasets, sys; datasets.disable_progress_bars(); "
                "print(datasets.load_dataset('json', data_files=sys.argv[2], split='train', "
                "cache_dir=sys.argv[1])['answer'])",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as root:
        paths = write_files(root, args.rows)
        table = []
        for kind in ("jsonl", "parquet"):
            mb = os.path.getsize(paths[kind]) / 1e6
            ours = [run(FSDPFN, paths[kind]) for _ in range(args.reps)]
            cold, warm = [], []
            for r in range(args.reps):
                cache = os.path.join(root, f"cache-{kind}-{r}")
                cold.append(run(DATASETS, cache, paths[kind]))
                warm.append(run(DATASETS, cache, paths[kind]))
            for name, runs in (("fsdpfn (read + check)", ours),
                               ("datasets, first load (cache written)", cold),
                               ("datasets, cache hit", warm)):
                table.append({"file": f"{kind} ({mb:.0f} MB)", "reader": name,
                              "rows": runs[0][0],
                              "median s": f"{statistics.median(x[1] for x in runs):.2f}",
                              "of it the import, s":
                                  f"{statistics.median(x[3] for x in runs):.2f}"})
        print_markdown_table(table, ("file", "reader"))
        print()
        print(f"A file whose line 7 is cut short ({paths['bad'].rsplit('/', 1)[-1]}):")
        print(f"- fsdpfn: {run(FSDPFN, paths['bad'])[2]}")
        print(f"- datasets: {run(DATASETS, os.path.join(root, 'cache-bad'), paths['bad'])[2]}")
        print()
        print('The answers of a file whose rows are "007", 12 and "1/2" (as written: '
              '[\'007\', 12, \'1/2\']):')
        for name, code in FIRST_ANSWERS.items():
            argv = [paths["mixed"]] if name == "fsdpfn" else [os.path.join(root, "c"),
                                                             paths["mixed"]]
            out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True,
                                 text=True)
            print(f"- {name}: {(out.stdout.strip() or out.stderr.strip().splitlines()[-1])}")


if __name__ == "__main__":
    main()
