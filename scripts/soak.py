"""Execute a notebook N times in fresh kernels and report hangs, deaths and durations.

Used to show the labs never hang on a small machine (the CPU collective deadlock):
    .venv/bin/python scripts/soak.py solutions/lab3-parallelism/lab3-parallelism.ipynb -n 20
"""

import argparse
import pathlib
import shutil
import statistics
import tempfile
import time

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebook", type=pathlib.Path)
    parser.add_argument("-n", "--runs", type=int, default=20)
    parser.add_argument("--cell-timeout", type=int, default=120)
    args = parser.parse_args()
    durations, failures = [], []
    for i in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            for support in args.notebook.parent.iterdir():
                shutil.copy(support, tmp)
            nb = nbformat.read(args.notebook, as_version=4)
            start = time.perf_counter()
            try:
                NotebookClient(nb, timeout=args.cell_timeout, kernel_name="python3",
                               resources={"metadata": {"path": tmp}}).execute()
                outcome = "ok"
            except (CellTimeoutError, DeadKernelError, CellExecutionError) as exc:
                outcome = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
                failures.append((i, outcome))
            durations.append(time.perf_counter() - start)
        print(f"run {i + 1:2d}/{args.runs}: {durations[-1]:6.1f} s  {outcome}", flush=True)
    print(f"{args.runs - len(failures)} passed, {len(failures)} failed; "
          f"median {statistics.median(durations):.1f} s, max {max(durations):.1f} s")
    raise SystemExit(1 if failures else 0)


if __name__ == "__main__":
    main()
