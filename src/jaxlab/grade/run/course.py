"""What a course adds around grading, kept in the output folder so that every later
``jaxlab grade`` and ``jaxlab report`` of it applies the same: who submitted each file
(Gradescope's export), the late policy, a Canvas roster, and the class's similarity check.

``.jaxlab/roster.json`` (``model.Roster``), ``.jaxlab/late-policy.json`` (``output.late.Policy``,
written when a deadline is given, replaced by the next one given; ``--extensions`` alone
updates its extensions), ``.jaxlab/canvas-roster.csv`` (a copy of the last one given) and
``.jaxlab/canvas-assignment.txt`` (the last ``--canvas-assignment`` given).
"""

import dataclasses
import json
import pathlib
import sys
import zipfile

from ..model import Record, Roster, write_atomically
from ..output import canvas as canvas_columns, late
from ..output.classreport import write_class_report
from ..output.gradebook import read_canvas_roster
from . import shard as shards

ROSTER = "roster.json"
POLICY = "late-policy.json"
CANVAS = "canvas-roster.csv"
CANVAS_ASSIGNMENT = "canvas-assignment.txt"


def roster_of(out):
    path = shards.state_dir(out) / ROSTER
    return Roster.read(path) if path.is_file() else None


def keep_roster(out, roster):
    path = shards.state_dir(out) / ROSTER
    path.parent.mkdir(parents=True, exist_ok=True)
    roster.write(path)


KEPT = "not in the latest export: graded from an earlier one, kept"  # grading_status


def graded_before(out, present):
    """The submissions the roster kept in ``out`` names that the export graded now lacks
    (``present``: its file keys; one whose folder is there is not lacking) and that were graded:
    {file: (Submitted, its record with KEPT in its grading_status)}. A student once graded
    stays in the class's files; the record, written when it was graded, is read from there."""
    old = roster_of(out)
    folders = {f.split("/")[0] for f in present}
    found = {}
    for file, sub in (old.files.items() if old else ()):
        if file in present or file.split("/")[0] in folders:
            continue
        try:
            record = Record.read(shards.state_dir(out) / shards.RECORDS /
                                 f"{shards.record_key(file)}.json")
        except (OSError, ValueError, TypeError, KeyError):  # never graded: nothing to keep
            continue
        if record.file == file:
            found[file] = (sub, dataclasses.replace(
                record, status=f"{KEPT}; {record.status}" if record.status else KEPT))
    return found


def with_graded_before(roster, kept):
    """``roster`` with the students of ``kept`` (``graded_before``)."""
    return Roster(roster.source, {**roster.files, **{f: sub for f, (sub, _) in kept.items()}})


def say_kept(kept, who="jaxlab grade"):
    """One line per submission ``graded_before`` keeps, naming its students."""
    for file, (sub, _) in kept.items():
        names = ", ".join(s.name or s.email or s.sid for s in sub.students) or "no student named"
        print(f"{who}: {names} ({sub.entry or file}): not in this export; graded before, so "
              "the row stays in final_grades.csv, gradescope_scores.csv and canvas_grades.csv, "
              "marked in grading_status", file=sys.stderr)


def policy_of(out, roster, *, deadline=None, late_penalty=None, grace=None, late_cap=None,
              cutoff=None, extensions=None):
    """The late policy for ``out``: made from the options given (a deadline replaces the kept
    policy; extensions alone update it), else the one kept; None without either. Checked in
    full (time zones, the extensions' students) before anything is graded or written."""
    path = shards.state_dir(out) / POLICY
    kept = late.Policy.read(path) if path.is_file() else None
    tuning = any(v is not None for v in (late_penalty, grace, late_cap, cutoff))
    if deadline is None and kept is None:
        if tuning or extensions is not None:
            raise late.BadPolicy("--late-penalty, --grace, --late-cap, --cutoff and --extensions "
                                 "need a --deadline (with its time zone)")
        return None
    if (deadline is not None or tuning or extensions is not None) and roster is None:
        raise late.BadPolicy("a late policy needs each submission's time: grade Gradescope's "
                             "export (with its submission_metadata.yml)")
    policy = kept
    if deadline is not None or tuning:
        rate, unit = late.parse_penalty(late_penalty) if late_penalty else (0.0, "day")
        base = kept if deadline is None and kept is not None else None
        policy = late.Policy(
            deadline=late.parse_time(deadline) if deadline is not None else base.deadline,
            rate=rate if late_penalty or base is None else base.rate,
            unit=unit if late_penalty or base is None else base.unit,
            grace=late.parse_duration(grace, "--grace") if grace else
            (base.grace if base else late.Policy.grace),
            cap=late.parse_percent(late_cap, "--late-cap") if late_cap else
            (base.cap if base else None),
            cutoff=_cutoff(cutoff) if cutoff else (base.cutoff if base else None),
            extensions=kept.extensions if kept else {},
            extensions_file=kept.extensions_file if kept else None)
    if extensions is not None:
        known = {s.key(): s for sub in roster.files.values() for s in sub.students}
        policy = dataclasses.replace(policy, extensions=late.read_extensions(extensions, known),
                                     extensions_file=str(extensions))
    return policy


def _cutoff(text):
    """--cutoff: a duration after each student's deadline, or a time with its zone."""
    try:
        return late.parse_duration(text, "--cutoff")
    except late.BadPolicy:
        return late.parse_time(text, "--cutoff")


def keep_policy(out, policy):
    if policy is not None:
        policy.write(shards.state_dir(out) / POLICY)


@dataclasses.dataclass(frozen=True)
class Canvas:
    """Canvas's side of a course: its gradebook export and which assignment column to fill."""

    roster: pathlib.Path | None = None  # the export given, else the copy kept; None: neither
    rows: list | None = None  # its students' rows (``gradebook.read_canvas_roster``)
    title: str | None = None  # --canvas-assignment, given or kept
    given: bool = False  # whether ``roster`` was given now (kept once everything is checked)
    title_given: bool = False


def canvas_of(out, given=None, title=None):
    """Canvas's side of the course in ``out``: the gradebook export ``given``, else the one
    kept, and the ``title`` of its column to fill (--canvas-assignment), else the one kept.
    Reads only: ``keep_canvas`` keeps what was given once ``canvas_column`` accepted it."""
    state = shards.state_dir(out)
    roster = pathlib.Path(given) if given is not None else \
        state / CANVAS if (state / CANVAS).is_file() else None
    kept_title = state / CANVAS_ASSIGNMENT
    return Canvas(roster, read_canvas_roster(roster) if roster else None,
                  title if title is not None else
                  kept_title.read_text(encoding="utf-8") if kept_title.is_file() else None,
                  given is not None, title is not None)


def canvas_column(canvas, lab):
    """The title of canvas_grades.csv's assignment column: with a Canvas gradebook export, the
    exact title of its column for ``lab`` (``output.canvas.column``, which refuses an export
    none of whose columns match); without, --canvas-assignment's, else the lab's name."""
    lab = lab or "assignment"
    if canvas.roster is None:
        return canvas.title or lab
    return canvas_columns.column(canvas.roster, lab, canvas.title)


def keep_canvas(out, canvas):
    """Keep the Canvas gradebook export and --canvas-assignment given, for later reports."""
    state = shards.state_dir(out)
    state.mkdir(parents=True, exist_ok=True)
    if canvas.given:
        write_atomically(state / CANVAS, canvas.roster.read_bytes())
    if canvas.title_given:
        write_atomically(state / CANVAS_ASSIGNMENT, canvas.title)


def lab_name(zip_path):
    """The assignment name an autograder zip's otter_config.json gives (None without one):
    known before the zip is opened, so that Canvas's column is checked before grading."""
    with zipfile.ZipFile(zip_path) as zf:
        try:
            return json.loads(zf.read("otter_config.json")).get("assignment_name")
        except KeyError:
            return None


def write_class_files(out, records, autograder, *, waiting=(), policy=None, canvas_roster=None,
                      canvas_column=None, template=None, show=True):
    """The class's files (``output.classreport``) with what the course keeps in ``out``, the
    similarity check's section on the page; ``canvas_column``: the title of canvas_grades.csv's
    assignment column (``canvas_column``)."""
    out = pathlib.Path(out)
    roster = roster_of(out)
    found = similar(out, records, template)
    unmatched = write_class_report(out, records, autograder, waiting=waiting, roster=roster,
                                   policy=policy, canvas_roster=canvas_roster,
                                   canvas_column=canvas_column, similar=found)
    if found is not None and found.flagged and show:
        print(f"jaxlab: {len(found.flagged)} pair(s) of submissions are more alike than the "
              f"task forces; see 'Similar submissions' in {out / 'report.html'}",
              file=sys.stderr)
    if unmatched and show:
        print(f"jaxlab: {len(unmatched)} student(s) match no row of the Canvas roster and have "
              f"no ID in canvas_grades.csv: {', '.join(unmatched[:10])}", file=sys.stderr)


def select(subs, roster, only):
    """The submissions among ``subs`` that ``only`` names, each by its file key, its folder in
    the export, or a submitter's name, email or SID (any case)."""
    wanted = {w.strip().lower() for w in only if w.strip()}
    chosen, matched = [], set()
    for s in subs:
        sub = roster.files.get(s.file) if roster else None
        names = {s.file.lower(), s.file.split("/")[0].lower()}
        for st in (sub.students if sub else ()):
            names |= {st.name.lower(), st.email.lower(), st.sid.lower()} - {""}
        hit = wanted & names
        if hit:
            chosen.append(s)
            matched |= hit
    missing = sorted(wanted - matched)
    if missing:
        raise ValueError(f"--only {', '.join(missing)}: no submission has that file name, "
                         "export folder, or student name, email or SID")
    return chosen


TEMPLATE = "template.ipynb"


def shipped_template(zip_path):
    """``student/<lab>/<lab>.ipynb`` beside ``autograder/<lab>-autograder.zip``, if there."""
    zip_path = pathlib.Path(zip_path).resolve()
    name = zip_path.name.removesuffix("-autograder.zip")
    path = zip_path.parent.parent / "student" / name / f"{name}.ipynb"
    return path if path.is_file() else None


def keep_template(out, template):
    """Keep the released student notebook in ``out`` for later reports (when one is known)."""
    if template is not None:
        dest = shards.state_dir(out) / TEMPLATE
        dest.parent.mkdir(parents=True, exist_ok=True)
        if pathlib.Path(template).resolve() != dest.resolve():
            write_atomically(dest, pathlib.Path(template).read_bytes())


def template_regions(out, template=None):
    """question -> the released notebook's cells of it (``template``, else the one kept in
    ``out``); None without either."""
    import nbformat

    from ..engine.cells import answer_regions

    path = pathlib.Path(template) if template else shards.state_dir(out) / TEMPLATE
    if not path.is_file():
        return None
    try:
        return answer_regions(nbformat.read(path, as_version=4))
    except Exception as exc:
        raise ValueError(f"the template notebook {path} cannot be read ({exc})") from None


def similar(out, records, template=None):
    """The similarity check over ``records`` (``output.similarity``), with the released
    notebook's starter code removed when it is known and the students of each file named when
    the roster is; None when no record kept answers."""
    from ..output import similarity

    if not any(r.answers or r.programs for r in records):
        return None
    regions = template_regions(out, template)
    result = similarity.compare(records, regions)
    roster = roster_of(out)
    if roster is not None:
        result.who = {f: ", ".join(s.name or s.email or s.sid for s in sub.students)
                      for f, sub in roster.files.items()}
    return result
