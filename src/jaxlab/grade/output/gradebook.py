"""Grades per student, and the files the gradebooks import.

With a roster (Gradescope's export), ``final_grades.csv`` gets one row per student of each
submission (a group submission counts for every member) with their name, SID, email and
submission time; with a late policy, also the penalty, the final score and why. From those rows:

* ``gradescope_scores.csv``: ``Name, SID, Email, Total Score, Max Points``, one row per student,
  the columns of Gradescope's own grade export, which its *Upload scores* matches to the roster
  by Email or SID;
* ``canvas_grades.csv``: Canvas's gradebook import layout: ``Student, ID, SIS User ID,
  SIS Login ID, Section`` and one assignment column, a ``Points Possible`` row first as Canvas's
  export writes it. Canvas matches rows by ID, else SIS User ID, else SIS Login ID; with a Canvas
  gradebook export given (``canvas_roster``) those columns and the assignment's column name are
  taken from it, else the SID fills SIS User ID and the email SIS Login ID.

A student in several submissions gets the latest of them in the gradebook files.
"""

import csv
import datetime
import pathlib

from ..model import instant

STUDENT_COLUMNS = ["name", "sid", "email", "submitted"]
LATE_COLUMNS = ["late_penalty", "final_score", "late_reason"]
GRADESCOPE_FILE = "gradescope_scores.csv"
CANVAS_FILE = "canvas_grades.csv"
CANVAS_POINTS_ROW = "    Points Possible"  # as Canvas's export writes it
CANVAS_ID_COLUMNS = ["Student", "ID", "SIS User ID", "SIS Login ID", "Section"]


class BadCanvasRoster(ValueError):
    """A Canvas gradebook export that cannot be read; the message names the file."""


def per_student(df, roster, policy=None):
    """otter's CSV frame ``df`` (first row: points per question) with one row per student of
    each submission and the roster's and the policy's columns."""
    import pandas as pd

    points, rows = df.iloc[:1].copy(), []
    possible = float(points["total_points_earned"].iloc[0]) if len(points) else 0.0
    for _, row in df.iloc[1:].iterrows():
        sub = roster.files.get(row["file"]) if roster else None
        students = sub.students if sub else (None,)
        for student in students:
            out = row.to_dict()
            out.update(name=student.name if student else "", sid=student.sid if student else "",
                       email=student.email if student else "", submitted=sub.time if sub else "")
            if policy is not None:
                when = datetime.datetime.fromisoformat(sub.time) if sub and sub.time else None
                raw = float(row["total_points_earned"])
                penalty, final, reason = policy.judge(when, tuple(s for s in students if s),
                                                      possible, raw)
                out.update(late_penalty=penalty, final_score=final, late_reason=reason)
            rows.append(out)
    for c in STUDENT_COLUMNS + (LATE_COLUMNS if policy is not None else []):
        points[c] = ""
    if policy is not None and len(points):
        points["final_score"] = possible
    frame = pd.concat([points, pd.DataFrame(rows, columns=list(points.columns))],
                      ignore_index=True)
    cols = list(df.columns)
    order = ["file", *STUDENT_COLUMNS, *cols[1:cols.index("percent_correct") + 1],
             *(LATE_COLUMNS if policy is not None else []), *cols[cols.index("percent_correct")
                                                                  + 1:]]
    return frame[order]


def latest_per_student(frame):
    """One row per student (by email, else SID, else name): the latest submission's."""
    rows = frame.iloc[1:].copy()
    rows["_key"] = [(e or s or n).strip().lower() for e, s, n in
                    zip(rows["email"].fillna(""), rows["sid"].fillna("").astype(str),
                        rows["name"].fillna(""))]
    rows = rows[rows["_key"] != ""]
    rows["_time"] = rows["submitted"].fillna("").map(instant)
    rows = rows.sort_values(["_key", "_time"]).groupby("_key", sort=False).tail(1)
    return rows.sort_values(["name", "_key"]).drop(columns=["_key", "_time"])


def score_column(frame):
    return "final_score" if "final_score" in frame.columns else "total_points_earned"


def write_gradescope(out, frame):
    rows = latest_per_student(frame)
    possible = float(frame[score_column(frame)].iloc[0])
    path = pathlib.Path(out) / GRADESCOPE_FILE
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["Name", "SID", "Email", "Total Score", "Max Points"])
        for _, r in rows.iterrows():
            w.writerow([r["name"], r["sid"], r["email"], _number(r[score_column(frame)]),
                        _number(possible)])
    return path


def read_canvas_roster(path):
    """The rows of a Canvas gradebook export: [{column: value}], without its points row."""
    path = pathlib.Path(path)
    try:
        rows = list(csv.DictReader(path.read_text(encoding="utf-8-sig").splitlines()))
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise BadCanvasRoster(f"--canvas-roster {path}: cannot be read ({exc})") from None
    if not rows or "Student" not in rows[0] or not ({"ID", "SIS User ID", "SIS Login ID"}
                                                   & set(rows[0])):
        raise BadCanvasRoster(f"--canvas-roster {path}: not a Canvas gradebook export (it needs "
                              "the columns Student, ID, SIS User ID, SIS Login ID, Section)")
    return [r for r in rows if (r.get("Student") or "").strip() not in
            ("Points Possible", "Student, Test")]


def write_canvas(out, frame, assignment, canvas_roster=None):
    """``canvas_grades.csv``; the students no row of ``canvas_roster`` matches, by name."""
    rows = latest_per_student(frame)
    possible = float(frame[score_column(frame)].iloc[0])
    column, unmatched, lines = assignment, [], []
    if canvas_roster:
        named = [c for c in canvas_roster[0] if c == assignment or c.startswith(f"{assignment} (")]
        column = named[0] if named else assignment
    for _, r in rows.iterrows():
        ids = {"Student": r["name"], "ID": "", "SIS User ID": r["sid"],
               "SIS Login ID": r["email"], "Section": ""}
        if canvas_roster:
            match = _canvas_match(canvas_roster, r)
            if match is None:
                unmatched.append(r["name"])
            else:
                ids = {c: match.get(c, "") for c in CANVAS_ID_COLUMNS}
        lines.append([ids[c] for c in CANVAS_ID_COLUMNS] + [_number(r[score_column(frame)])])
    path = pathlib.Path(out) / CANVAS_FILE
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(CANVAS_ID_COLUMNS + [column])
        w.writerow([CANVAS_POINTS_ROW, "", "", "", "", _number(possible)])
        w.writerows(lines)
    return unmatched


def _canvas_match(canvas_roster, r):
    sid, email, name = (str(r["sid"] or "").strip(), str(r["email"] or "").strip().lower(),
                        str(r["name"] or "").strip().lower())
    for row in canvas_roster:
        login = (row.get("SIS Login ID") or "").strip().lower()
        if sid and (row.get("SIS User ID") or "").strip() == sid:
            return row
        if email and login and (login == email or login == email.split("@")[0]):
            return row
    for row in canvas_roster:
        student = (row.get("Student") or "").strip().lower()
        last_first = " ".join(reversed([p.strip() for p in student.split(",", 1)]))
        if name and name in (student, last_first):
            return row
    return None


def _number(x):
    x = float(x)
    return f"{x:g}" if x == round(x, 6) else f"{x:.6g}"
