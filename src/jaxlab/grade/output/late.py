"""A course's late policy, applied to each student's score when the class's files are written.

The policy: a deadline (with its time zone); a penalty of ``rate`` percent of the assignment's
points for each started ``unit`` (day or hour) late; a grace period within which a submission
counts as on time (past it, lateness counts from the deadline itself); a cap on the penalty; a
cutoff after which a submission scores zero; and per-student extensions (a new deadline, or
more time) from a small CSV. The score never goes below zero.

Every duration is elapsed time, whatever the clock on the wall does: lateness is the real time
between the deadline and the submission, and an extension, a grace or a cutoff of ``36h`` ends
36 real hours after what it extends, across a daylight-saving change too. A day (``d``, and
the ``/day`` of a penalty) is 24 such hours, as in Canvas's late policy, which counts late
days as ``ceil(seconds late / 86400)`` (``LatePolicy#points_deducted`` in canvas-lms), started
units counting whole. Times are shown on the deadline's own clock.
"""

import csv
import dataclasses
import datetime
import json
import math
import pathlib
import re
import zoneinfo

from ..model import write_atomically

UNITS = {"day": datetime.timedelta(days=1), "hour": datetime.timedelta(hours=1)}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*(d|day|days|h|hr|hour|hours|m|min|minutes?)\b")
_STEP = {"d": "days", "day": "days", "days": "days", "h": "hours", "hr": "hours",
         "hour": "hours", "hours": "hours", "m": "minutes", "min": "minutes",
         "minute": "minutes", "minutes": "minutes"}


class BadPolicy(ValueError):
    """A deadline, penalty or extension that cannot be applied; the message says which."""


def parse_time(text, what="--deadline"):
    """An aware datetime from ISO 8601 with an offset ('2025-03-07T23:59-08:00') or a date and
    time followed by an IANA zone name ('2025-03-07 23:59 America/Los_Angeles')."""
    text = str(text).strip()
    zone = None
    m = re.fullmatch(r"(.+?)\s+([A-Za-z_]+(?:/[A-Za-z0-9_+\-]+)+|UTC|Z)", text)
    if m:
        text, name = m[1], m[2]
        try:
            zone = datetime.timezone.utc if name in ("UTC", "Z") else zoneinfo.ZoneInfo(name)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError):
            raise BadPolicy(f"{what} {m[0]!r}: {name!r} is not a time zone (use an IANA name "
                            "such as America/New_York, or an offset such as -05:00)") from None
    try:
        parsed = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise BadPolicy(f"{what} {text!r} is not a date and time (write e.g. "
                        "'2025-03-07 23:59 America/New_York' or '2025-03-07T23:59-05:00')") \
            from None
    if zone is not None:
        if parsed.tzinfo is not None:
            raise BadPolicy(f"{what} {m[0]!r} gives both an offset and a zone name; give one")
        return parsed.replace(tzinfo=zone)
    if parsed.tzinfo is None:
        raise BadPolicy(f"{what} {text!r} has no time zone, so it could mean any of 24 hours; "
                        f"add one, e.g. '{text} America/New_York' or '{parsed.isoformat()}"
                        "-05:00'")
    return parsed


def parse_duration(text, what):
    """'2d', '36h', '15m', '1d 12h' as a timedelta: elapsed time, a day being 24 hours."""
    text = str(text).strip().lower()
    pieces = list(_DURATION.finditer(text))
    if not pieces or _DURATION.sub("", text).strip():
        raise BadPolicy(f"{what} {text!r} is not a duration (write e.g. 15m, 36h or 2d)")
    return sum((datetime.timedelta(**{_STEP[p[2]]: float(p[1])}) for p in pieces),
               datetime.timedelta())


def parse_penalty(text):
    """'10%/day' or '2%/hour' -> (rate in percent, unit)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*%\s*(?:/|per)\s*(day|hour)\s*", str(text).lower())
    if not m:
        raise BadPolicy(f"--late-penalty {text!r}: write a percentage of the points per day or "
                        "per hour late, e.g. 10%/day or 2%/hour")
    return float(m[1]), m[2]


def parse_percent(text, what):
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*%?\s*", str(text))
    if not m or float(m[1]) > 100:
        raise BadPolicy(f"{what} {text!r}: write a percentage of the points, e.g. 50%")
    return float(m[1])


@dataclasses.dataclass(frozen=True)
class Policy:
    deadline: datetime.datetime
    rate: float = 0.0  # percent of the possible points per started unit late
    unit: str = "day"
    grace: datetime.timedelta = datetime.timedelta()
    cap: float | None = None  # the most percent a penalty takes
    cutoff: datetime.timedelta | datetime.datetime | None = None  # after it: zero
    extensions: dict = dataclasses.field(default_factory=dict)  # Student.key() -> Extension
    extensions_file: str | None = None

    def to_dict(self):
        cutoff = self.cutoff
        return {"deadline": self.deadline.isoformat(), "zone": _zone_name(self.deadline),
                "rate": self.rate, "unit": self.unit, "grace_s": self.grace.total_seconds(),
                "cap": self.cap,
                "cutoff": None if cutoff is None else
                {"after_s": cutoff.total_seconds()} if isinstance(cutoff, datetime.timedelta)
                else {"at": cutoff.isoformat(), "zone": _zone_name(cutoff)},
                "extensions": {k: e.to_dict() for k, e in self.extensions.items()},
                "extensions_file": self.extensions_file}

    @classmethod
    def from_dict(cls, raw):
        cutoff = raw.get("cutoff")
        return cls(deadline=_aware(raw["deadline"], raw.get("zone")), rate=raw["rate"],
                   unit=raw["unit"], grace=datetime.timedelta(seconds=raw["grace_s"]),
                   cap=raw.get("cap"),
                   cutoff=None if cutoff is None else
                   datetime.timedelta(seconds=cutoff["after_s"]) if "after_s" in cutoff
                   else _aware(cutoff["at"], cutoff.get("zone")),
                   extensions={k: Extension.from_dict(e)
                               for k, e in raw.get("extensions", {}).items()},
                   extensions_file=raw.get("extensions_file"))

    def write(self, path):
        write_atomically(path, json.dumps(self.to_dict(), indent=1))

    @classmethod
    def read(cls, path):
        return cls.from_dict(json.loads(pathlib.Path(path).read_text()))

    def deadline_for(self, students):
        """The deadline of a submission by ``students``: the most generous of their
        extensions, else the course's."""
        own = [self.extensions[s.key()].apply(self.deadline) for s in students
               if s.key() in self.extensions]
        return max(own, default=self.deadline, key=_utc)

    def judge(self, submitted, students, possible, raw):
        """(penalty in points, final score, reason in words) for a submission at ``submitted``
        (an aware datetime, or None when unknown) scoring ``raw`` of ``possible``."""
        if submitted is None:
            return 0.0, raw, "no submission time: no late penalty applied"
        due = self.deadline_for(students)
        extended = _utc(due) != _utc(self.deadline)
        due_words = f"the extended deadline {_show(due)}" if extended else "the deadline"
        late = _utc(submitted) - _utc(due)
        cutoff = after(due, self.cutoff) if isinstance(self.cutoff, datetime.timedelta) \
            else self.cutoff
        if cutoff is not None and _utc(submitted) > _utc(cutoff):
            return raw, 0.0, (f"submitted {_span(late)} after {due_words}, past the cutoff "
                              f"{_show(cutoff)}: scores zero")
        if late <= datetime.timedelta():
            return 0.0, raw, "on time" + (f" (extended deadline {_show(due)})" if extended else "")
        if late <= self.grace:
            return 0.0, raw, f"{_span(late)} after {due_words}, within the {_span(self.grace)} grace"
        units = math.ceil(late / UNITS[self.unit])
        percent = self.rate * units
        capped = self.cap is not None and percent > self.cap
        percent = min(percent, self.cap) if self.cap is not None else percent
        penalty = min(raw, possible * percent / 100)
        words = (f"{_span(late)} after {due_words}: {units} {self.unit}{'s' if units != 1 else ''}"
                 f" × {self.rate:g}% = {self.rate * units:g}%"
                 + (f", capped at {self.cap:g}%" if capped else "")
                 + f" of {possible:g} points = {possible * percent / 100:g} off")
        if penalty < possible * percent / 100:
            words += " (down to zero)"
        return round(penalty, 6), round(raw - penalty, 6), words


@dataclasses.dataclass(frozen=True)
class Extension:
    """One student's extension: a new deadline, or more time after the course's."""

    until: datetime.datetime | None = None
    more: datetime.timedelta | None = None

    def apply(self, deadline):
        return self.until if self.until is not None else after(deadline, self.more)

    def to_dict(self):
        return {"until": self.until.isoformat() if self.until else None,
                "zone": _zone_name(self.until) if self.until else None,
                "more_s": self.more.total_seconds() if self.more is not None else None}

    @classmethod
    def from_dict(cls, raw):
        return cls(_aware(raw["until"], raw.get("zone")) if raw.get("until") else None,
                   datetime.timedelta(seconds=raw["more_s"])
                   if raw.get("more_s") is not None else None)


ID_COLUMNS = ("email", "sid", "name")


def read_extensions(path, known):
    """{Student.key(): Extension} from a CSV with a column naming the student (``email``,
    ``sid`` or ``name``) and one giving the extension: ``extension`` (more time: 2d, 36h) or
    ``deadline`` (a new deadline with its zone). ``known``: {Student.key(): Student} of the
    submitters; a row naming anyone else is refused."""
    path = pathlib.Path(path)
    try:
        text = path.read_text(encoding="utf-8-sig")
    except (OSError, UnicodeDecodeError) as exc:
        raise BadPolicy(f"--extensions {path}: cannot be read ({exc})") from None
    rows = list(csv.DictReader(text.splitlines()))
    header = {(h or "").strip().lower(): h for h in (rows[0].keys() if rows else [])}
    ids = [c for c in ID_COLUMNS if c in header]
    given = [c for c in ("extension", "deadline") if c in header]
    if not ids or not given:
        raise BadPolicy(f"{path}: needs a column naming the student (email, sid or name) and "
                        f"one giving the extension ('extension' as 2d or 36h, or 'deadline' "
                        f"with its time zone); its columns are {', '.join(header) or 'none'}")
    by = {c: {} for c in ID_COLUMNS}
    for s in known.values():
        for c in ID_COLUMNS:
            value = getattr(s, c).strip().lower()
            if value:
                by[c].setdefault(value, s)
    found = {}
    for line, row in enumerate(rows, start=2):
        col = next((c for c in ids if (row.get(header[c]) or "").strip()), None)
        if col is None:
            raise BadPolicy(f"{path}, line {line}: names no student (empty "
                            f"{' and '.join(ids)})")
        who = row[header[col]].strip()
        student = by[col].get(who.lower())
        if student is None:
            raise BadPolicy(f"{path}, line {line}: no submitter has {col} {who!r} in this "
                            "export; fix the name or remove the row")
        where = f"{path}, line {line} ({who})"
        more = (row.get(header.get("extension", ""), "") or "").strip() \
            if "extension" in header else ""
        until = (row.get(header.get("deadline", ""), "") or "").strip() \
            if "deadline" in header else ""
        if bool(more) == bool(until):
            raise BadPolicy(f"{where}: give either an extension or a new deadline")
        found[student.key()] = Extension(more=parse_duration(more, where)) if more else \
            Extension(until=parse_time(until, where))
    return found


def after(t, delta):
    """``delta`` of elapsed time after ``t``, shown on ``t``'s clock. (Python adds a timedelta
    to an aware time on its wall clock: 2025-03-07 23:59 Los Angeles + 36 h gave 11:59 on
    March 9, 35 real hours later, as the clocks went forward that night.)"""
    return (_utc(t) + delta).astimezone(t.tzinfo)


def _utc(t):
    """``t`` in UTC: Python compares and subtracts two times of one zone on their wall clock."""
    return t.astimezone(datetime.timezone.utc)


def _aware(text, zone):
    parsed = datetime.datetime.fromisoformat(text)
    if zone:
        parsed = parsed.astimezone(zoneinfo.ZoneInfo(zone))
    return parsed


def _zone_name(t):
    return getattr(t.tzinfo, "key", None)


def _show(t):
    return t.strftime("%Y-%m-%d %H:%M") + (f" {t.tzname()}" if t.tzname() else "")


def _span(delta):
    """A duration in words: '2 d 3 h', '3 h 10 min', '45 s'."""
    s = int(round(abs(delta).total_seconds()))
    d, rest = divmod(s, 86400)
    h, rest = divmod(rest, 3600)
    m, sec = divmod(rest, 60)
    parts = [f"{d} d" if d else "", f"{h} h" if h else "", f"{m} min" if m and not d else "",
             f"{sec} s" if sec and not (d or h) else ""]
    return " ".join(p for p in parts if p) or "0 s"
