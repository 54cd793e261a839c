"""A 2-task Slurm array against one ``jaxlab grade --workers 2`` on the same folder, side by side;
and the report step's time for many synthetic records.

    .venv/bin/python benchmarks/shard_vs_batch.py           # root, with slurm-wlm and munge

The folder: ``--copies`` copies of the Lab 3 solution and ``--wrong`` notebooks with corpus
wrong answers (tests/answers/), named so that each of the 2 shards holds the same work: half
the copies, and one copy of each of ``--wrong / 2`` wrong notebooks (the hash split is even
only on average, and wrong answers differ in cost; this measures what sharding costs per
submission, not the luck of the split; docs/grading.md says what that luck costs). One warm-up first, into this run's own cache, shared
by both variants (a cluster pays it once per node, a machine once per autograder): its time
is printed, not counted. Then, ``--rounds`` times, in alternating order:

* the array: a one-node Slurm cluster on this machine (tests/grade/slurmcluster.py), ``jaxlab
  slurm --tasks 2 --cpus-per-task 1 --submit``; from submission until the report job (which
  depends on the array) has ended: the array, Slurm's scheduling, and ``jaxlab report``;
* one batch: ``jaxlab grade --workers 2`` (which writes the same files itself).

Both must write the same final_grades.csv; the ratio array / batch is printed per round.
Then ``--records`` synthetic records (a real solution record, with questions failed at random
with the corpus's failure messages and other numbers) are put in a folder with their manifest
and ``jaxlab report`` is timed on it, as a process of its own.
"""

import argparse
import copy
import json
import os
import pathlib
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import nbformat

from jaxlab.grade import grade
from jaxlab.grade.model import Record
from jaxlab.grade.output.results import CSV
from jaxlab.grade.run.shard import Manifest, Shard, current_split, keep_autograder, record_key, \
    shard_of, write_manifest
from jaxlab.grade.run.slurm import slurm

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAB = "lab3-parallelism"
AUTOGRADER = ROOT / "autograder" / f"{LAB}-autograder.zip"
SOLUTION = ROOT / "solutions" / LAB / f"{LAB}.ipynb"
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "grade"))
from jaxlab.corpus import Release, load_answers  # noqa: E402
from slurmcluster import Cluster  # noqa: E402


def names_per_shard(kind, per, shards=2):
    """``per`` names ``kind-NN.ipynb`` for each shard: {shard: [names]}."""
    names, i = {k: [] for k in range(shards)}, 0
    while any(len(v) < per for v in names.values()):
        name = f"{kind}-{i:02d}.ipynb"
        if len(names[shard_of(name, shards)]) < per:
            names[shard_of(name, shards)].append(name)
        i += 1
    return names


def build(folder, copies, wrong, seed=1):
    """``copies`` solutions and ``wrong`` wrong-answer notebooks, half of each in each shard of
    2; each wrong notebook's content twice, once in each shard (the same work on both sides:
    wrong answers differ in cost, and a split by name is not a split by cost)."""
    folder.mkdir(parents=True)
    for names in names_per_shard("solution", copies // 2).values():
        for name in names:
            shutil.copy(SOLUTION, folder / name)
    release = Release(LAB)
    corpus = [a for a in load_answers(LAB) if not a.correct]
    rng = random.Random(seed)
    per_shard = names_per_shard("wrong", wrong // 2)
    for pair in zip(*per_shard.values()):
        picks = {a.question: a for a in rng.sample(corpus, 3)}
        nb = release.notebook_with(list(picks.values()))
        for name in pair:
            nbformat.write(nb, folder / name)
    return folder


def run_batch(subs, out, show=False):
    start = time.monotonic()
    assert grade(paths=[str(subs)], output_dir=str(out), autograder=str(AUTOGRADER), workers=2,
                 show=show)
    return time.monotonic() - start


def run_array(cluster, subs, out, cache):
    start = time.monotonic()
    jobs = slurm(paths=[str(subs)], output_dir=str(out), tasks=2, cpus_per_task=1,
                 autograder=str(AUTOGRADER), node_cache=str(cache), submit=True, show=False)
    state = cluster.wait(jobs.report_job, timeout=3600)["JobState"]
    assert state == "COMPLETED", state
    took = time.monotonic() - start
    # where the array's time went: each task's own time, the slowest's end to the report's
    ended = time.time()
    split = current_split(out)
    for k, m in sorted(split.manifests.items()):
        graded = [Record.read(out / ".jaxlab" / "records" / f"{record_key(f)}.json").seconds
                  for f in m.files]
        print(f"  shard {k}/2: {len(m.files)} submissions, task {m.finished - m.started:.1f} s "
              f"(their grading {sum(graded):.1f} s)")
    last = max(m.finished for m in split.manifests.values())
    first = min(m.started for m in split.manifests.values())
    print(f"  submission to the first task's start {took - (ended - first):.1f} s; last task's "
          f"end to the report job's end (dependency, `jaxlab report`) {ended - last:.1f} s")
    return took


MESSAGE_NUMBERS = re.compile(r"\d+")


def synthetic(out, template, n, messages, seed=2):
    """``n`` records like ``template`` with questions failed at random, and their manifest."""
    rng = random.Random(seed)
    folder = out / ".jaxlab" / "records"
    folder.mkdir(parents=True)
    files = {}
    for i in range(n):
        r = copy.deepcopy(template)
        r.file, r.sha256 = f"student-{i:05d}.ipynb", f"{i:064x}"
        for q, data in r.questions.items():
            if rng.random() < 0.3:
                r.outcomes[q] = "fail"
                for case in data["cases"]:
                    if case["points"]:
                        case["passed"] = False
                        case["message"] = MESSAGE_NUMBERS.sub(
                            lambda m: str(rng.randint(0, 64)), rng.choice(messages[q]))
        r.write(folder / f"{record_key(r.file)}.json")
        files[r.file] = r.sha256
    write_manifest(out, Manifest(shard=Shard(0, 1), files=files,
                                 autograder=keep_autograder(out, AUTOGRADER), started=0.0,
                                 finished=0.0))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--copies", type=int, default=4, help="solution copies (even)")
    ap.add_argument("--wrong", type=int, default=4, help="wrong-answer notebooks (even)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--records", type=int, default=2000)
    args = ap.parse_args()
    work = pathlib.Path(tempfile.mkdtemp(prefix="shard-bench-"))
    os.environ["JAXLAB_CACHE_DIR"] = str(work / "cache")
    cluster = Cluster(work / "slurm")
    try:
        subs = build(work / "submissions", args.copies, args.wrong)
        print(f"{args.copies} solution copies + {args.wrong} wrong-answer notebooks (each "
              f"content in both shards); shard 0 "
              f"holds {sum(shard_of(p.name, 2) == 0 for p in subs.iterdir())}, shard 1 "
              f"{sum(shard_of(p.name, 2) == 1 for p in subs.iterdir())}")
        (work / "one").mkdir()
        shutil.copy(SOLUTION, work / "one" / "solution.ipynb")
        run_batch(work / "one", work / "warm", show=True)  # prints the warm-up's time
        cluster.start()
        os.environ["SLURM_CONF"] = str(cluster.conf)  # for sbatch
        ratios = []
        for i in range(args.rounds):
            order = ("batch", "array") if i % 2 == 0 else ("array", "batch")
            t = {}
            for variant in order:
                out = work / f"{variant}-{i}"
                t[variant] = run_batch(subs, out) if variant == "batch" else \
                    run_array(cluster, subs, out, work / "cache")
            same = (work / f"array-{i}" / CSV).read_text() == \
                (work / f"batch-{i}" / CSV).read_text()
            ratios.append(t["array"] / t["batch"])
            print(f"round {i + 1} ({' then '.join(order)}): array {t['array']:.1f} s, "
                  f"batch {t['batch']:.1f} s, array / batch {ratios[-1]:.3f}, "
                  f"final_grades.csv identical: {same}")
        print(f"array / batch: {', '.join(f'{r:.3f}' for r in ratios)} "
              f"(mean {statistics.mean(ratios):.3f}; target <= 1.10)")
        records = [Record.read(p)
                   for p in (work / "batch-0" / ".jaxlab" / "records").glob("*.json")]
        for kind in ("solution", "wrong"):
            mine = [r for r in records if r.file.startswith(kind)]
            cells = [r.cell_seconds for r in mine]
            whole = [r.seconds for r in mine]
            print(f"{kind} ({len(mine)}), per submission on its core: student cells (as its "
                  f"kernels timed them) mean {statistics.mean(cells):.1f} s "
                  f"(min {min(cells):.1f}, max {max(cells):.1f}); graded in "
                  f"{statistics.mean(whole):.1f} s (min {min(whole):.1f}, max {max(whole):.1f})")
    finally:
        cluster.stop()
    # the report step on many records
    template = next(r for r in records if r.file.startswith("solution"))
    messages = {}
    for r in records:
        for q, data in r.questions.items():
            messages.setdefault(q, []).extend(
                c["message"] for c in data["cases"] if c["points"] and not c["passed"]
                and c["message"])
    for q in template.questions:
        messages[q] = messages.get(q) or [f"`{q}` is wrong by 3 of 8 values"]
    big = work / "report-bench"
    synthetic(big, template, args.records, messages)
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "jaxlab", "report", str(big)],
                          capture_output=True, text=True)
    took = time.monotonic() - start
    assert done.returncode == 0, done.stderr[-2000:]
    rows = sum(1 for _ in open(big / CSV)) - 2
    print(f"jaxlab report on {args.records} synthetic records: {took:.1f} s (target < 10 s); "
          f"{rows} rows, report.html {(big / 'report.html').stat().st_size / 1e6:.1f} MB")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
