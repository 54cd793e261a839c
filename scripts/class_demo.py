"""Build a class of Lab 3 submissions from the answer corpus and grade it, to see report.html.

    .venv/bin/python scripts/class_demo.py /tmp/class --students 30   # then open
    /tmp/class/grades/report.html (and /tmp/class/report.png, with chromium installed)

Each student answers each question with the solution, or (with probability --wrong) with one of
the corpus's wrong answers for it (tests/answers/lab3-parallelism/*.yaml), drawn with a fixed
seed. Besides them: the blank student notebook, a file that is not a notebook, and a notebook
whose cell ignores interrupts and hangs (timed out). ``--shards N`` grades it as N shards one
after another and merges them with ``jaxlab report``, as a Slurm array would.
"""

import argparse
import pathlib
import random
import shutil
import subprocess
import sys

import nbformat

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAB = "lab3-parallelism"
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "grade"))
from jaxlab.corpus import Release, load_answers  # noqa: E402  (shared with the tests)

HANG = "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True:\n    " \
       "time.sleep(1)"


def build(folder, students, wrong, seed):
    subs = folder / "submissions"
    subs.mkdir(parents=True)
    release = Release(LAB)
    corpus = {}
    for a in load_answers(LAB):
        if not a.correct:
            corpus.setdefault(a.question, []).append(a)
    rng = random.Random(seed)
    for i in range(students):
        picks = [rng.choice(corpus[q]) for q in sorted(corpus) if rng.random() < wrong]
        nbformat.write(release.notebook_with(picks), subs / f"student-{i + 1:03d}.ipynb")
    shutil.copy(release.student, subs / "blank.ipynb")
    (subs / "not-a-notebook.ipynb").write_text("I could not get it to run, sorry")
    hang = release.notebook_with([])
    q8 = release.answer_cell["q8_sharded_training"]
    hang.cells.insert(q8 + 1, nbformat.v4.new_code_cell(HANG))
    nbformat.write(hang, subs / "hangs-in-q8.ipynb")
    return subs


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=pathlib.Path)
    ap.add_argument("--students", type=int, default=30)
    ap.add_argument("--wrong", type=float, default=0.25,
                    help="chance that a student answers a question wrong")
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--timeout", default="240")
    ap.add_argument("--shards", type=int, default=1)
    args = ap.parse_args()
    if args.folder.exists():
        shutil.rmtree(args.folder)
    subs = build(args.folder, args.students, args.wrong, args.seed)
    out = args.folder / "grades"
    jaxlab = [sys.executable, "-m", "jaxlab"]
    common = [str(subs), "-o", str(out), "--timeout", args.timeout, "--cell-timeout", "60",
              "--autograder", str(ROOT / "autograder" / f"{LAB}-autograder.zip")]
    if args.shards == 1:
        subprocess.run([*jaxlab, "grade", *common], check=True)
    else:
        for k in range(args.shards):
            subprocess.run([*jaxlab, "grade", *common, "--shard", f"{k}/{args.shards}"],
                           check=True)
        subprocess.run([*jaxlab, "report", str(out)], check=True)
    browser = shutil.which("chromium")
    if browser:
        subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                        "--disable-background-networking", "--hide-scrollbars",
                        f"--user-data-dir={args.folder / 'chromium-profile'}",
                        f"--screenshot={args.folder / 'report.png'}", "--window-size=1200,4200",
                        (out / "report.html").resolve().as_uri()], check=True,
                       capture_output=True)
        print(f"screenshot: {args.folder / 'report.png'}")
    print(f"report: {out / 'report.html'}")


if __name__ == "__main__":
    main()
