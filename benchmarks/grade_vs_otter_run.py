"""Grade N copies of a solution with ``jaxlab grade`` and with a loop of ``otter run``; compare.

    python benchmarks/grade_vs_otter_run.py --autograder autograder/lab3-parallelism-autograder.zip \\
        --submission solutions/lab3-parallelism/lab3-parallelism.ipynb

Prints both wall times, their ratio and whether every copy got the same scores both ways.
Extra ``jaxlab grade`` settings (no prestart, no compilation cache, XLA threads) can be compared
with ``--variant``.
"""

import argparse
import json
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

import pandas as pd

from jaxlab.grade import grade

VARIANTS = {
    "default": {},
    "no-cache": {"compile_cache": False},
    "no-prestart": {"prestart": False},
    "unpinned": {"pin_cpus": False},
    "1-thread": {"xla_threads": 1},
    "1-worker": {"workers": 1},
}


def otter_run_loop(autograder, copies, out):
    otter = pathlib.Path(sys.executable).with_name("otter")
    scores = {}
    for path in copies:
        dest = out / path.stem
        dest.mkdir(parents=True)
        subprocess.run([str(otter), "run", "-a", str(autograder), "-o", str(dest), str(path)],
                       check=True, capture_output=True)
        tests = json.loads((dest / "results.json").read_text())["tests"]
        scores[path.name] = {t["name"]: float(t["score"]) for t in tests if "score" in t}
    return scores


def jaxlab_scores(out):
    df = pd.read_csv(out / "final_grades.csv").set_index("file").drop("points-per-question")
    questions = [c for c in df.columns
                 if c not in ("total_points_earned", "percent_correct", "grading_status")]
    return {f: {q: float(df.loc[f, q]) for q in questions} for f in df.index}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--autograder", required=True)
    ap.add_argument("--submission", required=True)
    ap.add_argument("--copies", type=int, default=16)
    ap.add_argument("--variant", action="append", choices=list(VARIANTS))
    ap.add_argument("--skip-otter", action="store_true")
    args = ap.parse_args()
    work = pathlib.Path(tempfile.mkdtemp(prefix="jaxlab-bench-"))
    subs = work / "subs"
    subs.mkdir()
    copies = [shutil.copy(args.submission, subs / f"copy{i:02d}.ipynb") for i in range(args.copies)]
    copies = [pathlib.Path(c) for c in copies]
    results = {}
    for variant in args.variant or ["default"]:
        out = work / f"grade-{variant}"
        t = time.perf_counter()
        grade(paths=[str(subs)], output_dir=str(out), autograder=args.autograder,
              show=False, **VARIANTS[variant])
        results[variant] = (time.perf_counter() - t, jaxlab_scores(out))
        print(f"jaxlab grade [{variant}]: {results[variant][0]:.1f} s", flush=True)
    if not args.skip_otter:
        t = time.perf_counter()
        theirs = otter_run_loop(args.autograder, copies, work / "otter")
        otter_s = time.perf_counter() - t
        print(f"otter run loop: {otter_s:.1f} s for {len(copies)} copies")
        for variant, (seconds, ours) in results.items():
            same = ours == theirs
            print(f"[{variant}] jaxlab grade / otter run = {seconds / otter_s:.2f} "
                  f"(target <= 0.33); identical scores: {same}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
