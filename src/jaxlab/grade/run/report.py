"""``jaxlab report``: the class's files written from the records every shard left, as one batch
grading every submission would have written them."""

import pathlib
import shutil
import sys
import tempfile

from ..engine.autograder import open_autograder
from ..output.results import CSV, GRADESCOPE, SUMMARIES, stem, write_submission
from ..output.tally import print_table, question_table
from . import course, shard as shards


def report(*, output_dir="grades", show=True, deadline=None, late_penalty=None, grace=None,
           late_cap=None, cutoff=None, extensions=None, canvas_roster=None,
           canvas_assignment=None, template=None):
    """Write final_grades.csv, the summaries, the Gradescope JSON, score_distribution.png and
    report.html in ``output_dir`` from the records its shards wrote, as one batch grading every
    submission there would have. True when every submission of the current split has a record;
    otherwise what is graded is written, and the shards still to run are printed.
    With Gradescope's export graded there, also the gradebook files, with the late policy kept
    there or given (``deadline`` ... ``extensions``: ``run.course.policy_of``), canvas_grades.csv
    filling the column of ``canvas_roster`` (given or kept) that ``canvas_assignment`` (given or
    kept) or the lab's name picks (``run.course.canvas_column``); the page's similarity section
    compares with ``template`` (default: the released notebook kept there). What is given is
    kept only once all of it is checked."""
    out = pathlib.Path(output_dir)
    roster = course.roster_of(out)
    policy = course.policy_of(out, roster, deadline=deadline, late_penalty=late_penalty,
                              grace=grace, late_cap=late_cap, cutoff=cutoff,
                              extensions=extensions)
    canvas = course.canvas_of(out, canvas_roster, canvas_assignment)
    split = shards.current_split(out)
    files = split.files()
    records = shards.records_of(out, files)
    graded = [records[f] for f in files if f in records]
    # graded from an earlier export that the latest lacks: their rows stay, marked
    kept = course.graded_before(out, files) if roster is not None else {}
    ordered = graded + [r for _, r in kept.values()]
    names = {m.autograder for m in split.manifests.values() if m.autograder}
    if len(names) != 1:
        raise ValueError(f"the shards of {out} were graded with {len(names)} different "
                         "autograders" if names else f"{out} names no autograder zip")
    zip_path = shards.state_dir(out) / shards.AUTOGRADERS / names.pop()
    column = course.canvas_column(canvas, course.lab_name(zip_path))
    course.keep_policy(out, policy)
    course.keep_canvas(out, canvas)
    waiting = [f"shard {m.shard}: {k} not graded yet" for m in split.manifests.values()
               if (k := sum(f not in records for f in m.files))]
    if split.missing():
        many = len(split.missing()) > 1
        waiting.append(f"shard{'s' if many else ''} {_ranges(split.missing())} of "
                       f"{split.count}: never started")
    if show:
        course.say_kept(kept, "jaxlab report")
    scratch = pathlib.Path(tempfile.mkdtemp(prefix="jaxlab-report-"))
    try:
        ag = open_autograder(zip_path, scratch)
        for r in graded:  # a shard wrote these as it graded; only a missing or older one again
            if _older_than_record(out, r):
                write_submission(out, r, ag)
        course.write_class_files(out, ordered, ag, waiting=waiting, policy=policy,
                                 canvas_roster=canvas.rows, canvas_column=column,
                                 template=template, show=show)
        if show:
            print_table(question_table(ordered, ag))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if waiting:
        print(f"jaxlab report: {len(graded)} of {len(files)} submissions graded so far "
              f"({'; '.join(waiting)}); run those shards again, then `jaxlab report` again",
              file=sys.stderr)
    elif show:
        print(f"jaxlab report: {len(graded)} submissions from {split.count} shard"
              f"{'s' if split.count != 1 else ''} in {out / CSV}", file=sys.stderr)
    return not waiting


def _older_than_record(out, record):
    record_time = (shards.state_dir(out) / shards.RECORDS /
                   f"{shards.record_key(record.file)}.json").stat().st_mtime
    for path in (out / SUMMARIES / f"{stem(record.file)}.txt",
                 out / GRADESCOPE / f"{stem(record.file)}.json"):
        try:
            if path.stat().st_mtime < record_time:
                return True
        except FileNotFoundError:
            return True
    return False


def _ranges(indexes):
    """[0, 2, 3, 4, 7] -> "0, 2-4, 7"."""
    runs = []
    for i in sorted(indexes):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)




def similar(*, output_dir="grades", template=None, show=True):
    """The similarity check alone over the records of ``output_dir``: prints the most similar
    pairs and writes ``similar_pairs.csv``; the ``output.similarity.Result``."""
    from ..output import similarity

    out = pathlib.Path(output_dir)
    split = shards.current_split(out)
    files = split.files()
    records = shards.records_of(out, files)
    ordered = [records[f] for f in files if f in records]
    result = course.similar(out, ordered, template)
    if result is None:
        raise ValueError(f"the records in {out} keep no answers to compare (graded by an older "
                         "jaxlab: grade again with --force)")
    similarity.write_csv(out, result)
    if show:
        similarity.print_pairs(result)
    return result
