"""Which column of Canvas's gradebook ``canvas_grades.csv`` fills.

Canvas's gradebook export (``--canvas-roster``) titles each assignment's column with the
assignment's name and its Canvas id, e.g. ``Lab 4: shard_map (90210)``; Canvas's import matches
a column to an assignment by that id, then by the title, and makes a new assignment of a column
it matches to none. So ``canvas_grades.csv`` takes the exact title of one of the export's own
assignment columns: the one ``--canvas-assignment`` names, else the one titled as the lab is
named (letters and digits compared, so ``lab4-shard-map`` finds ``Lab 4: shard_map (90210)``).
An export none of whose assignment columns match is refused with their titles listed.
"""

import csv
import re

from .gradebook import BadCanvasRoster

ASSIGNMENT = re.compile(r"(?P<title>.*?)\s*\((?P<id>\d+)\)\s*")  # "Lab 4: shard_map (90210)"


def assignment_columns(path):
    """The assignment columns' titles in Canvas's gradebook export at ``path``, in its order
    (the ones with an id; Canvas's read-only totals have none)."""
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            header = next(csv.reader(f), [])
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise BadCanvasRoster(f"--canvas-roster {path}: cannot be read ({exc})") from None
    return [c for c in header if ASSIGNMENT.fullmatch(c)]


def _key(text):
    """``text`` as compared with a lab's name: its letters and digits, in any case."""
    return "".join(ch for ch in text.casefold() if ch.isalnum())


def column(path, lab, title=None):
    """The exact title of the column of ``path`` (Canvas's gradebook export) that
    ``canvas_grades.csv`` fills: the one ``title`` names (a whole column title, or a title
    without its id), else the one titled as ``lab`` (the autograder's assignment name)."""
    columns = assignment_columns(path)
    wanted = title if title is not None else lab
    found = [c for c in columns if c == wanted] or \
        [c for c in columns if _key(ASSIGNMENT.fullmatch(c)["title"]) == _key(wanted)]
    if len(found) == 1:
        return found[0]
    named = f"--canvas-assignment {wanted!r}" if title is not None else \
        f"this lab's name, {wanted!r},"
    if not columns:
        raise BadCanvasRoster(f"--canvas-roster {path}: has no assignment column (Canvas titles "
                              "them 'Title (id)'); create the assignment in Canvas, export its "
                              "gradebook again and give that file")
    if found:
        raise BadCanvasRoster(f"--canvas-roster {path}: {named} matches {len(found)} assignment "
                              f"columns ({', '.join(map(repr, found))}); give the one to fill "
                              "with --canvas-assignment and its whole title")
    raise BadCanvasRoster(f"--canvas-roster {path}: no assignment column matches {named} so "
                          "canvas_grades.csv would make a new assignment; its assignment columns "
                          f"are {', '.join(map(repr, columns))}: name the one to fill with "
                          "--canvas-assignment TITLE")
