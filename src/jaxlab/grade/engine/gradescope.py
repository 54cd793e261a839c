"""Read Gradescope's *Export Submissions* archive: who submitted each folder, and when.

The archive (or the folder it unpacks to, possibly inside one top folder such as
``assignment_123_export/``) holds ``submission_metadata.yml`` and one folder per submission
named by its entry there. The file is YAML written from Ruby, so its keys carry Ruby's leading
colon::

    submission_123456:
      :submitters:
      - :name: Ann Lee
        :sid: '1001'
        :email: ann@example.edu
      :created_at: 2025-03-07 23:41:09.123456000 -08:00
      :score: 15.0
      ...

(the layout read by open-source tools that take this export: see docs/grading.md, *Gradescope's
export*). Each folder holds what the student uploaded: here a notebook or a ``grader.export()``
zip. Everything this module refuses, it refuses with one sentence naming the file and the entry;
a zip is checked before anything is unpacked, so a refused one leaves the kept copy as it was.
"""

import dataclasses
import datetime
import pathlib
import shutil
import sys
import tempfile
import zipfile

from ..model import Roster, Student, Submitted, instant
from .submissions import SUFFIXES, Submission

METADATA = "submission_metadata.yml"
STAMP = ".unpacked-from"  # in the unpacked folder: which zip (path, size, time) it holds


class BadExport(ValueError):
    """The export cannot be read as Gradescope writes it; the message names the file and entry."""


@dataclasses.dataclass(frozen=True)
class Export:
    """An export found among the paths given to ``jaxlab grade``."""

    root: pathlib.Path  # the folder holding submission_metadata.yml
    roster: Roster
    submissions: list  # Submission, file keys "submission_123456/<name>"
    warnings: list  # sentences for the instructor
    # entry -> the sentence for an entry of submission_metadata.yml without its folder, said
    # unless the caller has more to say of it (a submission graded before: run.course)
    absent: dict = dataclasses.field(default_factory=dict)


def find(paths, unpack_to):
    """The Gradescope export among ``paths`` (a folder or zip holding ``submission_metadata.yml``),
    or None when there is none. A zip is unpacked under ``unpack_to`` (kept: regrades read it).
    An export must be the only path given."""
    found = [p for p in map(pathlib.Path, paths) if _metadata_in(p) is not None]
    if not found:
        return None
    if len(paths) > 1:
        raise BadExport(f"{found[0]} is a Gradescope export; grade it alone (got {len(paths)} "
                        "paths)")
    given = found[0]
    if given.is_file():
        given = _unpack(given, pathlib.Path(unpack_to))
    root = _metadata_in(given).parent
    roster, warnings, absent = read(root)
    folders = sorted(p.name for p in root.iterdir() if p.is_dir()
                     and not p.name.startswith(".") and p.name != "__MACOSX")
    subs = []
    for folder in sorted({*roster.files, *folders}):
        sub, note = _pick(root / folder)
        if folder not in roster.files:
            if sub is not None:  # graded all the same: nothing handed in is dropped
                warnings.append(f"{root / folder}: this folder is not an entry of {METADATA}; "
                                "it is graded, but its row names no student and the gradebook "
                                "files leave it out")
            else:
                continue
        if note:
            warnings.append(f"{root / folder}: {note}")
        if sub is not None:
            subs.append(sub)
    files = {s.file.split("/")[0]: s.file for s in subs}
    roster.files = {files[f]: s for f, s in roster.files.items() if f in files}
    return Export(root, roster, subs, warnings, absent)


def _metadata_in(path):
    """``submission_metadata.yml`` in folder ``path`` or its only subfolder; for a zip, the
    name of that member; else None."""
    if path.is_dir():
        for folder in [path, *_only_subfolder(path)]:
            if (folder / METADATA).is_file():
                return folder / METADATA
        return None
    if path.suffix.lower() == ".zip" and zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as zf:
            names = [n for n in zf.namelist() if pathlib.PurePosixPath(n).name == METADATA
                     and len(pathlib.PurePosixPath(n).parts) <= 2]
        return pathlib.Path(names[0]) if names else None
    return None


def _only_subfolder(path):
    subs = [p for p in path.iterdir() if p.is_dir() and not p.name.startswith((".", "__MACOSX"))]
    return subs if len(subs) == 1 else []


def _unpack(zip_path, dest):
    """Unpack the export into ``dest`` (again only when the zip changed); that folder. Shards
    of one batch may unpack at once: each unpacks into a folder of its own and renames it into
    place, and a shard that finds another's copy of the same zip there takes it."""
    mark = f"{zip_path.resolve()} {zip_path.stat().st_size} {zip_path.stat().st_mtime_ns}"

    def current():
        stamp = dest / STAMP
        return stamp.is_file() and stamp.read_text() == mark

    if current():
        return dest
    member = _metadata_in(zip_path).as_posix()
    with zipfile.ZipFile(zip_path) as zf:
        data = zf.read(member)
    parse(data, f"{zip_path}: {member}")  # refused here, nothing on disk has changed yet
    dest.parent.mkdir(parents=True, exist_ok=True)
    fresh = pathlib.Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    with zipfile.ZipFile(zip_path) as zf:
        for m in zf.infolist():
            parts = pathlib.PurePosixPath(m.filename).parts
            if m.is_dir() or not parts or m.filename.startswith("/") or ".." in parts \
                    or parts[0] == "__MACOSX":
                continue
            target = fresh.joinpath(*parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(m) as src, open(target, "wb") as out:
                shutil.copyfileobj(src, out)
    (fresh / STAMP).write_text(mark)
    stale = None
    if dest.exists() and not current():  # an older export: set aside, removed below
        stale = fresh.with_name(fresh.name + "-stale")
        try:
            dest.rename(stale)
        except FileNotFoundError:  # another shard moved it first
            stale = None
    try:
        fresh.rename(dest)
    except OSError:  # another shard's copy got there first
        shutil.rmtree(fresh, ignore_errors=True)
        if not current():
            raise BadExport(f"{zip_path}: could not unpack it into {dest} (another process "
                            "is unpacking a different export there)") from None
    if stale is not None:
        shutil.rmtree(stale, ignore_errors=True)
    return dest


def parse(data, where):
    """``submission_metadata.yml``'s text or bytes as the mapping it must be; ``where`` names
    it in the refusal (the file given, and the entry inside a zip)."""
    import yaml

    try:
        raw = yaml.safe_load(data)
    except yaml.YAMLError as exc:
        line = f" at line {_line(exc)}" if _line(exc) else ""
        said = str(getattr(exc, "problem", None) or exc) + \
            (f" ({exc.context})" if getattr(exc, "context", None) else "")
        raise BadExport(f"{where} is not valid YAML{line}: {said}") from None
    except UnicodeDecodeError as exc:
        raise BadExport(f"{where} cannot be read: {exc}") from None
    if not isinstance(raw, dict):
        raise BadExport(f"{where} should map each submission folder to its submitters; it "
                        f"holds {type(raw).__name__}")
    return raw


def _line(exc):
    """The line (from 1; YAML's marks count from 0) of a YAML error: where the token the
    scanner could not finish starts, else where the parser stopped. A key without its ':' is
    found only on the next line: "could not find expected ':'", with the key's line as the
    context."""
    import yaml

    mark = getattr(exc, "problem_mark", None)
    if isinstance(exc, yaml.scanner.ScannerError) and exc.context_mark is not None:
        mark = exc.context_mark
    return mark.line + 1 if mark is not None else None


def read(root):
    """The roster of the export in folder ``root`` (keyed by entry, e.g. "submission_123"),
    warnings about its entries, and {entry: a sentence naming its students} for the entries
    whose folder is missing."""
    path = pathlib.Path(root) / METADATA
    try:
        text = path.read_bytes()
    except OSError as exc:
        raise BadExport(f"{path} cannot be read: {exc}") from None
    raw = parse(text, str(path))
    files, warnings, seen, absent = {}, [], {}, {}
    for entry, data in raw.items():
        entry = str(entry)
        where = f"{path}, entry {entry!r}"
        students, time, problems = _entry(data)
        if not (pathlib.Path(root) / entry).is_dir():
            absent[entry] = (f"{where}: no folder {entry}/ in the export; nothing to grade for "
                             f"{', '.join(s.name or s.key() for s in students) or 'it'}")
            continue
        warnings.extend(f"{where}: {p}" for p in problems)
        for s in students:
            seen.setdefault(s.key(), []).append((entry, time, s))
        files[entry] = Submitted(tuple(students), time, entry)
    for key, entries in seen.items():
        if len(entries) > 1:
            latest = max(entries, key=lambda e: instant(e[1]))
            warnings.append(f"{path}: {entries[0][2].name} ({key}) is a submitter of "
                            f"{', '.join(e[0] for e in entries)}; every row is graded, and the "
                            f"gradebook files take the latest, {latest[0]}")
    return Roster(str(path), files), warnings, absent


def _entry(data):
    """(students, time, problems) of one entry: what is malformed in it is left out and said in
    ``problems``, so that its folder is still graded."""
    if not isinstance(data, dict):
        return [], "", [f"expected :submitters and :created_at, found {type(data).__name__}; "
                        "graded, but its row names no student and has no submission time"]
    problems, students = [], []
    submitters = data.get(":submitters")
    if not isinstance(submitters, list) or not submitters:
        problems.append("expected a list of :submitters (each with :name, :sid, :email); "
                        "graded, but its row names no student")
        submitters = []
    for i, s in enumerate(submitters):
        student = Student(*(_text(s.get(k)) for k in (":name", ":sid", ":email"))) \
            if isinstance(s, dict) else None
        if student is None or not student.key():
            problems.append(f"submitter {i + 1} has no :name, :sid or :email; left out")
        else:
            students.append(student)
    time, problem = _time(data.get(":created_at"))
    if problem:
        problems.append(f":created_at {problem}; graded with no submission time, so no late "
                        "penalty applies")
    return students, time, problems


def _text(value):
    return "" if value is None else str(value).strip()


def _time(value):
    """(``:created_at`` as ISO 8601 with its offset or "", what is wrong with it or None)."""
    if value is None or value == "":
        return "", None
    if isinstance(value, datetime.datetime):
        parsed = value
    else:
        text = str(value).strip()
        parsed = None
        for candidate in (text, _ruby_time(text)):
            try:
                parsed = datetime.datetime.fromisoformat(candidate)
                break
            except (TypeError, ValueError):
                continue
        if parsed is None:
            return "", f"{text!r} is not a time"
    if parsed.tzinfo is None:
        return "", f"{value} has no UTC offset"
    return parsed.isoformat(), None


def _ruby_time(text):
    """'2025-03-07 23:41:09.123456789 -08:00' (Ruby's form) as fromisoformat reads it."""
    parts = text.split()
    if len(parts) != 3:
        return None
    date, clock, offset = parts
    if "." in clock:
        whole, frac = clock.split(".", 1)
        clock = f"{whole}.{frac[:6].ljust(6, '0')}"
    return f"{date}T{clock}{offset}"


def _pick(folder):
    """The one notebook or zip a submission folder holds: (Submission or None, note or None)."""
    found = sorted(p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in SUFFIXES
                   and not any(part.startswith(".") or part == "__MACOSX"
                               for part in p.relative_to(folder).parts))
    notebooks = [p for p in found if p.suffix.lower() == ".ipynb"]
    chosen = notebooks or found
    if not chosen:
        return None, "holds no notebook or zip; nothing to grade"
    note = None
    if len(chosen) > 1:
        note = (f"holds {len(chosen)} candidates ({', '.join(p.name for p in chosen)}); "
                f"grading {chosen[0].name}")
    rel = chosen[0].relative_to(folder.parent).as_posix()
    return Submission(rel, chosen[0]), note


def say(warnings):
    for w in warnings:
        print(f"jaxlab grade: {w}", file=sys.stderr)
