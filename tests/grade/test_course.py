"""What a course adds around grading, unit by unit: Gradescope's export read, the late policy's
arithmetic, the gradebooks' files as those tools read them, and the similarity check."""

import csv
import datetime
import io
import pathlib
import re
import shutil
import zipfile
import zoneinfo

import pandas as pd
import pytest

from jaxlab.grade.engine import gradescope
from jaxlab.grade.model import Record, Roster, Student, Submitted
from jaxlab.grade.output import gradebook, late, similarity

EXPORT = pathlib.Path(__file__).parent / "fixtures" / "gradescope_export"
PACIFIC = datetime.timezone(datetime.timedelta(hours=-8))
ENTRIES = ["submission_301000001", "submission_301000002", "submission_301000003",
           "submission_301000009", "submission_301000010"]  # the fixture's, in its order


def export_copy(root, notebooks=True):
    shutil.copytree(EXPORT, root)
    for folder in ENTRIES:
        (root / folder).mkdir()
        if notebooks:
            (root / folder / "lab.ipynb").write_text("{}")
    return root


# --------------------------------------------------------------------------- the export
def test_export_folder_gives_each_submission_its_students_and_time(tmp_path):
    found = gradescope.find([str(export_copy(tmp_path / "export"))], tmp_path / "unpacked")
    assert found.warnings == []
    assert [s.file for s in found.submissions] == [f"{e}/lab.ipynb" for e in ENTRIES]
    group = found.roster.files["submission_301000002/lab.ipynb"]
    assert [s.name for s in group.students] == ["Bo Chen", "Cara Diaz"]
    assert group.students[1] == Student("Cara Diaz", "1003", "cara.diaz@example.edu")
    assert datetime.datetime.fromisoformat(group.time) == \
        datetime.datetime(2025, 3, 8, 2, 15, tzinfo=PACIFIC)
    assert group.entry == "submission_301000002"
    # an SID with leading zeros stays text; a student without SID; names as written; a time
    # in UTC ("... Z") read as that instant
    zoe = found.roster.files["submission_301000009/lab.ipynb"]
    assert zoe.students == (Student("Zoë Ångström", "00421", "zoe.angstrom@example.edu"),)
    assert datetime.datetime.fromisoformat(zoe.time) == \
        datetime.datetime(2025, 3, 7, 23, 40, 12, 938335, tzinfo=PACIFIC)
    jose = found.roster.files["submission_301000010/lab.ipynb"]
    assert jose.students == (Student("José Núñez", "", "jose.nunez@example.edu"),)
    assert jose.time == "2025-03-08T09:30:00+00:00"


def test_export_zip_with_a_top_folder_is_unpacked_and_read_alike(tmp_path):
    root = export_copy(tmp_path / "assignment_9_export")
    archive = tmp_path / "submissions.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for p in sorted(root.rglob("*")):
            if p.is_file():
                zf.write(p, p.relative_to(tmp_path).as_posix())
    found = gradescope.find([str(archive)], tmp_path / "unpacked")
    assert len(found.submissions) == 5
    assert all(s.path.is_file() and tmp_path / "unpacked" in s.path.parents
               for s in found.submissions)
    assert found.roster.files["submission_301000001/lab.ipynb"].students[0].name == "Ann Lee"


def test_shards_unpacking_one_export_at_once_all_read_it_and_a_new_zip_replaces_it(tmp_path):
    import concurrent.futures
    import os

    root = export_copy(tmp_path / "assignment_9_export")
    archive = tmp_path / "submissions.zip"
    shutil.make_archive(str(archive.with_suffix("")), "zip", tmp_path, root.name)
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        found = list(pool.map(lambda _: gradescope.find([str(archive)], tmp_path / "unpacked"),
                              range(6)))
    assert all(len(f.submissions) == 5 and all(s.path.is_file() for s in f.submissions)
               for f in found)
    # the export downloaded again, with a submission more: unpacked afresh
    (root / "submission_301000003" / "lab.ipynb").unlink()
    shutil.make_archive(str(archive.with_suffix("")), "zip", tmp_path, root.name)
    os.utime(archive, ns=(1, 1))
    again = gradescope.find([str(archive)], tmp_path / "unpacked")
    assert [s.file.split("/")[0] for s in again.submissions] == [
        e for e in ENTRIES if e != "submission_301000003"]
    assert sorted(p.name for p in (tmp_path).iterdir() if p.name.startswith(".")) == []
    assert [p.name for p in (tmp_path / "unpacked").parent.iterdir()
            if p.name.startswith(".unpacked")] == []


def test_not_an_export_is_left_to_the_usual_search(tmp_path):
    (tmp_path / "a.ipynb").write_text("{}")
    assert gradescope.find([str(tmp_path)], tmp_path / "x") is None


def test_malformed_metadata_names_the_file_and_the_line(tmp_path):
    root = export_copy(tmp_path / "export")
    (root / gradescope.METADATA).write_text("submission_1:\n  :submitters: [\n")
    with pytest.raises(gradescope.BadExport, match=r"submission_metadata.yml is not valid YAML "
                                                   r"at line \d"):
        gradescope.find([str(root)], tmp_path / "x")
    (root / gradescope.METADATA).write_text("- just\n- a list\n")
    with pytest.raises(gradescope.BadExport, match="should map each submission folder"):
        gradescope.find([str(root)], tmp_path / "x")


def files_under(folder):
    """Every path under ``folder`` (folders too), files with their bytes."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() if p.is_file() else None
            for p in sorted(folder.rglob("*"))}


def test_a_broken_export_zip_is_refused_by_its_own_name_and_line_and_changes_nothing(tmp_path):
    from click.testing import CliRunner

    from jaxlab.cli import main

    root = export_copy(tmp_path / "assignment_9_export")
    archive = shutil.make_archive(str(tmp_path / "first"), "zip", tmp_path, root.name)
    grades = tmp_path / "grades"
    gradescope.find([archive], grades / ".jaxlab" / "export")
    before = files_under(grades)
    # downloaded again, and one key on a line of José's entry lost its ':' (a hand edit)
    meta = root / gradescope.METADATA
    lines = meta.read_text().splitlines(keepends=True)
    n = max(i for i, line in enumerate(lines, 1) if line == "  :score: 15.0\n")
    lines[n - 1] = "  :score 15.0\n"
    meta.write_text("".join(lines))
    again = shutil.make_archive(str(tmp_path / "again"), "zip", tmp_path, root.name)
    said = f"{again}: assignment_9_export/submission_metadata.yml is not valid YAML at line {n}: " \
           "could not find expected ':' (while scanning a simple key)"
    with pytest.raises(gradescope.BadExport) as refused:
        gradescope.find([again], grades / ".jaxlab" / "export")
    assert str(refused.value) == said
    assert files_under(grades) == before  # the kept copy, which regrades read, included
    # an output folder that does not exist yet is not made
    with pytest.raises(gradescope.BadExport):
        gradescope.find([again], tmp_path / "new" / ".jaxlab" / "export")
    assert not (tmp_path / "new").exists()
    # on the command line: that sentence alone, no usage banner, nothing written
    result = CliRunner().invoke(main, ["grade", again, "-o", str(grades)])
    assert (result.exit_code, result.output) == (2, f"Error: {said}\n")
    assert files_under(grades) == before


def test_a_malformed_entry_is_named_and_its_folder_still_graded(tmp_path):
    root = export_copy(tmp_path / "export")
    text = (root / gradescope.METADATA).read_text()
    text = text.replace("  :submitters:\n  - :name: Ann Lee\n    :sid: '1001'\n"
                        "    :email: ann.lee@example.edu\n", "")
    text = text.replace("2025-03-08 00:10:00.000000000 -08:00", "next tuesday")
    text = text.replace("  - :name: Cara Diaz\n    :sid: '1003'\n    :email: cara.diaz@example.edu",
                        "  - 42")
    (root / gradescope.METADATA).write_text(text)
    found = gradescope.find([str(root)], tmp_path / "x")
    assert len(found.submissions) == 5
    said = "\n".join(found.warnings)
    assert "entry 'submission_301000001': expected a list of :submitters" in said, said
    assert "entry 'submission_301000002': submitter 2 has no :name, :sid or :email" in said
    assert "entry 'submission_301000003': :created_at 'next tuesday' is not a time" in said
    assert len(found.warnings) == 3
    files = found.roster.files
    assert files["submission_301000001/lab.ipynb"].students == ()
    assert [s.name for s in files["submission_301000002/lab.ipynb"].students] == ["Bo Chen"]
    assert files["submission_301000003/lab.ipynb"].time == ""


def test_a_folder_missing_from_the_metadata_and_an_entry_without_folder_are_named(tmp_path):
    root = export_copy(tmp_path / "export")
    (root / "submission_999").mkdir()
    (root / "submission_999" / "lab.ipynb").write_text("{}")
    (root / "submission_998").mkdir()  # no notebook: not a submission, nothing said
    shutil.rmtree(root / "submission_301000003")
    found = gradescope.find([str(root)], tmp_path / "x")
    # the stray folder is graded all the same, with no student named
    assert [s.file.split("/")[0] for s in found.submissions] == [
        "submission_301000001", "submission_301000002", "submission_301000009",
        "submission_301000010", "submission_999"]
    assert "submission_999/lab.ipynb" not in found.roster.files
    assert any("submission_999: this folder is not an entry of submission_metadata.yml; it is "
               "graded, but its row names no student" in w for w in found.warnings), found.warnings
    # said by the caller, which knows whether it was graded before (run.course.graded_before)
    assert list(found.absent) == ["submission_301000003"]
    assert "entry 'submission_301000003': no folder submission_301000003/ in the export; " \
           "nothing to grade for Dev Patel" in found.absent["submission_301000003"]
    assert len(found.warnings) == 1


def test_a_student_in_two_submissions_is_named_and_the_latest_counts(tmp_path):
    root = export_copy(tmp_path / "export")
    text = (root / gradescope.METADATA).read_text().replace(
        "Dev Patel\n    :sid: '1004'\n    :email: dev.patel", "Ann Lee\n    :sid: '1001'\n"
        "    :email: ann.lee")
    (root / gradescope.METADATA).write_text(text)
    found = gradescope.find([str(root)], tmp_path / "x")
    (warning,) = found.warnings
    assert "Ann Lee (ann.lee@example.edu) is a submitter of submission_301000001, " \
           "submission_301000003" in warning and "the latest, submission_301000003" in warning
    # the latest in time, whatever the offsets say as text
    (root / gradescope.METADATA).write_text(text.replace(
        "2025-03-08 00:10:00.000000000 -08:00", "2025-03-07 23:30:00.000000000 +05:00"))
    (warning,) = gradescope.find([str(root)], tmp_path / "x").warnings
    assert "the latest, submission_301000001" in warning


# --------------------------------------------------------------------------- the late policy
DEADLINE = "2025-03-07 23:59 America/Los_Angeles"
ANN = Student("Ann Lee", "1001", "ann@x.edu")


def at(text):
    return late.parse_time(text, "t")


def test_a_deadline_without_time_zone_is_refused_with_how_to_write_one():
    with pytest.raises(late.BadPolicy, match=r"--deadline '2025-03-07 23:59' has no time zone.*"
                                             r"America/New_York"):
        late.parse_time("2025-03-07 23:59")
    assert at("2025-03-07T23:59-08:00") == at(DEADLINE)  # PST in March before DST
    with pytest.raises(late.BadPolicy, match="'Mars/Olympus' is not a time zone"):
        late.parse_time("2025-03-07 23:59 Mars/Olympus")


@pytest.mark.parametrize("submitted,penalty,reason", [
    ("2025-03-07 23:59 America/Los_Angeles", 0, "on time"),
    ("2025-03-08 00:14 America/Los_Angeles", 0, "within the 15 min grace"),
    # one second past the grace: lateness counts from the deadline, one started day
    ("2025-03-08 00:14:01 America/Los_Angeles", 2, "1 day × 10%"),
    ("2025-03-08 23:59 America/Los_Angeles", 2, "1 day × 10%"),
    ("2025-03-08 23:59:01 America/Los_Angeles", 4, "2 days × 10%"),
    ("2025-03-11 12:00 America/Los_Angeles", 8, "4 days × 10% = 40%"),
    # five started days would be 50%: the cap holds it at 40%
    ("2025-03-12 12:00 America/Los_Angeles", 8, "capped at 40%"),
    # the cutoff is 6 days (144 real hours) after the deadline: 00:59 on March 14, as the
    # clocks went forward on the 9th; at it still late, past it zero
    ("2025-03-14 00:59 America/Los_Angeles", 8, "capped at 40%"),
    ("2025-03-14 01:00 America/Los_Angeles", 15, "past the cutoff"),
])
def test_late_penalty_per_started_day_with_grace_cap_and_cutoff(submitted, penalty, reason):
    policy = late.Policy(deadline=at(DEADLINE), rate=10, unit="day",
                         grace=datetime.timedelta(minutes=15), cap=40,
                         cutoff=datetime.timedelta(days=6))
    got_penalty, final, words = policy.judge(at(submitted), (ANN,), possible=20, raw=15)
    assert (got_penalty, final) == (penalty, 15 - penalty), words
    assert reason in words


def test_hourly_penalty_never_takes_the_score_below_zero():
    policy = late.Policy(deadline=at(DEADLINE), rate=25, unit="hour")
    penalty, final, words = policy.judge(at("2025-03-08 01:30 America/Los_Angeles"), (ANN,),
                                         possible=10, raw=3)
    assert (penalty, final) == (3, 0) and "2 hours × 25% = 50%" in words and "down to zero" in words


def test_extensions_move_a_students_deadline_and_cutoff(tmp_path):
    bo = Student("Bo Chen", "1002", "bo@x.edu")
    ext = tmp_path / "extensions.csv"
    ext.write_text("email,extension,deadline\nann@x.edu,2d,\n,1d,\n")
    known = {s.key(): s for s in (ANN, bo)}
    with pytest.raises(late.BadPolicy, match=r"extensions.csv, line 3: names no student"):
        late.read_extensions(ext, known)
    ext.write_text("sid,extension,deadline\n1001,2d,\n1002,,2025-03-09 12:00 America/Los_Angeles\n")
    policy = late.Policy(deadline=at(DEADLINE), rate=10, cutoff=datetime.timedelta(days=1),
                         extensions=late.read_extensions(ext, known))
    assert policy.judge(at("2025-03-09 23:00 America/Los_Angeles"), (ANN,), 20, 20)[:2] == (0, 20)
    assert policy.judge(at("2025-03-10 01:00 America/Los_Angeles"), (bo,), 20, 20)[:2] == (2, 18)
    # a group's deadline is its most generous member's
    assert policy.judge(at("2025-03-09 23:00 America/Los_Angeles"), (bo, ANN), 20, 20)[:2] == \
        (0, 20)
    # the cutoff (one day after each student's own deadline) moved with Ann's extension, which
    # ends 48 real hours after the deadline: 00:59 on March 10, the clocks having gone forward
    assert policy.judge(at("2025-03-11 00:59 America/Los_Angeles"), (ANN,), 20, 20)[1] == 18
    assert policy.judge(at("2025-03-11 01:00 America/Los_Angeles"), (ANN,), 20, 20)[1] == 0
    restored = late.Policy.from_dict(policy.to_dict())
    assert restored.judge(at("2025-03-10 01:00 America/Los_Angeles"), (bo,), 20, 20) == \
        policy.judge(at("2025-03-10 01:00 America/Los_Angeles"), (bo,), 20, 20)


def test_an_extension_for_a_student_not_in_the_export_is_refused(tmp_path):
    ext = tmp_path / "ext.csv"
    ext.write_text("email,extension\nann@x.edu,1d\nghost@x.edu,2d\n")
    with pytest.raises(late.BadPolicy, match=r"ext.csv, line 3: no submitter has email "
                                             r"'ghost@x.edu' in this export"):
        late.read_extensions(ext, {ANN.key(): ANN})



# Daylight-saving changes in both semesters and both zones: (zone, a deadline two days before
# the clocks change, where a 36-hour extension ends on the local clock, real hours between
# the two on the wall clock). US and EU clocks change on different Sundays.
CLOCK_CHANGES = [
    ("America/Los_Angeles", "2025-03-07 23:59", "2025-03-09 12:59 PDT"),  # forward, March 9
    ("America/Los_Angeles", "2025-10-31 23:59", "2025-11-02 10:59 PST"),  # back, November 2
    ("Europe/Berlin", "2025-03-28 23:59", "2025-03-30 12:59 CEST"),  # forward, March 30
    ("Europe/Berlin", "2025-10-24 23:59", "2025-10-26 10:59 CET"),  # back, October 26
]
UTC = datetime.timezone.utc


def extended(zone, deadline, extension, tmp_path, **policy):
    ext = tmp_path / "extensions.csv"
    ext.write_text(f"email,extension\n{ANN.email},{extension}\n")
    return late.Policy(deadline=at(f"{deadline} {zone}"), rate=10, unit="day",
                       extensions=late.read_extensions(ext, {ANN.key(): ANN}), **policy)


@pytest.mark.parametrize("zone,deadline,ends", CLOCK_CHANGES)
def test_an_extension_in_hours_or_minutes_is_elapsed_time_across_a_clock_change(
        zone, deadline, ends, tmp_path):
    for extension, hours in (("36h", 36), ("2190m", 36.5)):
        policy = extended(zone, deadline, extension, tmp_path)
        due = policy.deadline_for((ANN,))
        assert due.astimezone(UTC) - policy.deadline.astimezone(UTC) == \
            datetime.timedelta(hours=hours)
        if extension == "36h":
            assert late._show(due) == ends
        # 30 minutes inside the real extension: not charged; a minute past its end: one day
        for before, charged in ((datetime.timedelta(minutes=30), 0),
                                (-datetime.timedelta(minutes=1), 2)):
            when = (due.astimezone(UTC) - before).astimezone(zoneinfo.ZoneInfo(zone))
            penalty, final, words = policy.judge(when, (ANN,), possible=20, raw=20)
            assert penalty == charged, (extension, when, words)
            # the same instant as the export writes it, with its UTC offset
            exported = datetime.datetime.fromisoformat(when.isoformat())
            assert policy.judge(exported, (ANN,), possible=20, raw=20) == \
                (penalty, final, words)
        assert late.Policy.from_dict(policy.to_dict()).deadline_for((ANN,)) == due


def test_the_issues_spring_deadline_with_36h_ends_at_1259_on_march_9(tmp_path):
    policy = extended("America/Los_Angeles", "2025-03-07 23:59", "36h", tmp_path)
    for submitted in ("2025-03-09 12:29 America/Los_Angeles", "2025-03-09T12:29:00-07:00"):
        assert policy.judge(at(submitted), (ANN,), 20, 20) == \
            (0, 20, "on time (extended deadline 2025-03-09 12:59 PDT)")
    assert policy.judge(at("2025-03-09 13:00 America/Los_Angeles"), (ANN,), 20, 20)[:2] == \
        (2, 18)


@pytest.mark.parametrize("zone,deadline,ends", CLOCK_CHANGES)
def test_a_day_is_24_real_hours_as_in_canvas_late_policy(zone, deadline, ends, tmp_path):
    """A 2d extension, a 2d cutoff and each day of a per-day penalty are 48 and 24 real hours
    (Canvas: ceil(seconds late / 86400)), wherever the wall clock is then."""
    tz = zoneinfo.ZoneInfo(zone)
    start = at(f"{deadline} {zone}").astimezone(UTC)

    def local(hours):
        return (start + datetime.timedelta(hours=hours)).astimezone(tz)

    policy = extended(zone, deadline, "2d", tmp_path)
    assert policy.deadline_for((ANN,)).astimezone(UTC) == start + datetime.timedelta(days=2)
    plain = late.Policy(deadline=at(f"{deadline} {zone}"), rate=10, unit="day",
                        cutoff=datetime.timedelta(days=2))
    # 47.5 real hours late: two started days, not past the two-day cutoff, on either clock
    assert plain.judge(local(47.5), (ANN,), 20, 20)[:2] == (4, 16)
    assert plain.judge(local(48.5), (ANN,), 20, 20)[:2] == (20, 0)
    assert plain.judge(local(24.5), (ANN,), 20, 20)[:2] == (4, 16)
    assert plain.judge(local(23.5), (ANN,), 20, 20)[:2] == (2, 18)


@pytest.mark.parametrize("zone,deadline", [("America/Los_Angeles", "2025-03-09 01:55"),
                                           ("Europe/Berlin", "2025-03-30 01:55")])
def test_grace_is_elapsed_time_on_the_night_the_clocks_go_forward(zone, deadline):
    policy = late.Policy(deadline=at(f"{deadline} {zone}"), rate=10,
                         grace=datetime.timedelta(minutes=15))
    # 03:05 on the wall is 10 real minutes after 01:55 that night
    penalty, _, words = policy.judge(at(f"{deadline[:10]} 03:05 {zone}"), (ANN,), 20, 20)
    assert penalty == 0 and "10 min after the deadline, within the 15 min grace" in words
    penalty, _, words = policy.judge(at(f"{deadline[:10]} 03:11 {zone}"), (ANN,), 20, 20)
    assert penalty == 2 and words.startswith("16 min after the deadline"), words

# --------------------------------------------------------------------------- the gradebooks
def frame(policy=None):
    df = pd.DataFrame([
        {"file": "points-per-question", "q1": 2.0, "q2": 1.0, "total_points_earned": 3.0,
         "percent_correct": 1.0, "grading_status": "--"},
        {"file": "submission_1/lab.ipynb", "q1": 2.0, "q2": 1.0, "total_points_earned": 3.0,
         "percent_correct": 1.0, "grading_status": "Completed"},
        {"file": "submission_2/lab.ipynb", "q1": 2.0, "q2": 0.0, "total_points_earned": 2.0,
         "percent_correct": 2 / 3, "grading_status": "Completed"},
        {"file": "submission_3/lab.ipynb", "q1": 0.0, "q2": 1.0, "total_points_earned": 1.0,
         "percent_correct": 1 / 3, "grading_status": "Completed"}])
    roster = Roster("m.yml", {
        "submission_1/lab.ipynb": Submitted((ANN,), "2025-03-07T20:00:00-08:00", "submission_1"),
        "submission_2/lab.ipynb": Submitted((Student("Bo Chen", "1002", "bo@x.edu"),
                                             Student("Cara, Diaz", "1003", "cara@x.edu")),
                                            "2025-03-08T10:00:00-08:00", "submission_2"),
        # Ann again, later: the gradebooks take this one
        "submission_3/lab.ipynb": Submitted((ANN,), "2025-03-08T09:00:00-08:00", "submission_3")})
    return gradebook.per_student(df, roster, policy)


def test_final_grades_has_a_row_per_student_with_raw_score_penalty_final_and_reason():
    policy = late.Policy(deadline=at(DEADLINE), rate=10)
    df = frame(policy)
    assert list(df.columns) == ["file", "name", "sid", "email", "submitted", "q1", "q2",
                                "total_points_earned", "percent_correct", "late_penalty",
                                "final_score", "late_reason", "grading_status"]
    assert list(df["name"]) == ["", "Ann Lee", "Bo Chen", "Cara, Diaz", "Ann Lee"]
    bo = df[df["name"] == "Bo Chen"].iloc[0]
    assert (bo["total_points_earned"], bo["late_penalty"], bo["final_score"]) == (2, 0.3, 1.7)
    assert "1 day × 10% = 10% of 3 points = 0.3 off" in bo["late_reason"]
    assert df.iloc[0]["final_score"] == 3


def test_gradescope_scores_csv_reads_back_one_row_per_student_matched_by_email_or_sid(tmp_path):
    df = frame(late.Policy(deadline=at(DEADLINE), rate=10))
    gradebook.write_gradescope(tmp_path, df)
    back = pd.read_csv(tmp_path / gradebook.GRADESCOPE_FILE, dtype={"SID": str})
    assert list(back.columns) == ["Name", "SID", "Email", "Total Score", "Max Points"]
    assert back.set_index("Email")["Total Score"].to_dict() == {
        "ann@x.edu": 0.7, "bo@x.edu": 1.7, "cara@x.edu": 1.7}  # Ann: her later submission
    assert set(back["SID"]) == {"1001", "1002", "1003"} and set(back["Max Points"]) == {3}


def test_canvas_csv_has_canvas_columns_points_row_and_ids_from_its_own_export(tmp_path):
    df = frame()
    canvas_export = tmp_path / "canvas.csv"
    canvas_export.write_text(
        "Student,ID,SIS User ID,SIS Login ID,Section,lab (8812),Quiz 1 (8800)\n"
        "    Points Possible,,,,,3.00,5.00\n"
        '"Lee, Ann",501,1001,alee,CS 101,,4\n'
        '"Chen, Bo",502,1002,bchen,CS 101,,3\n')
    roster = gradebook.read_canvas_roster(canvas_export)
    unmatched = gradebook.write_canvas(tmp_path, df, "lab", roster)
    assert unmatched == ["Cara, Diaz"]
    with open(tmp_path / gradebook.CANVAS_FILE, newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["Student", "ID", "SIS User ID", "SIS Login ID", "Section", "lab (8812)"]
    assert rows[1][0].strip() == "Points Possible" and rows[1][5] == "3"
    got = {r[0]: r for r in rows[2:]}
    assert got["Lee, Ann"] == ["Lee, Ann", "501", "1001", "alee", "CS 101", "1"]
    assert got["Chen, Bo"][1] == "502" and got["Chen, Bo"][5] == "2"
    # pandas reads it as Canvas's own export reads: the assignment column is numeric
    back = pd.read_csv(tmp_path / gradebook.CANVAS_FILE, skiprows=[1])
    assert back["lab (8812)"].dtype.kind == "f" or back["lab (8812)"].dtype.kind == "i"
    # without a Canvas export the SID and email fill SIS User ID and SIS Login ID
    gradebook.write_canvas(tmp_path, df, "lab")
    plain = pd.read_csv(tmp_path / gradebook.CANVAS_FILE, skiprows=[1], dtype=str)
    assert list(plain.columns) == ["Student", "ID", "SIS User ID", "SIS Login ID", "Section",
                                   "lab"]
    assert plain.set_index("SIS User ID")["SIS Login ID"].to_dict()["1002"] == "bo@x.edu"


# Canvas's gradebook export as instructors title their assignments, with its read-only totals
CANVAS_EXPORT = (
    "Student,ID,SIS User ID,SIS Login ID,Section,Lab 3: parallelism (90209),"
    "Lab 4: shard_map (90210),Labs Current Score,Labs Final Score,Current Score,Final Score\n"
    "    Points Possible,,,,,20.00,3.00,(read only),(read only),(read only),(read only)\n"
    '"Lee, Ann",501,1001,alee,CS 101,18,,90,90,90,90\n'
    '"Chen, Bo",502,1002,bchen,CS 101,20,,100,100,100,100\n')


def test_canvas_csv_fills_the_column_titled_as_instructors_title_it(tmp_path):
    from jaxlab.grade.output import canvas

    export = tmp_path / "canvas.csv"
    export.write_text(CANVAS_EXPORT)
    assert canvas.assignment_columns(export) == ["Lab 3: parallelism (90209)",
                                                 "Lab 4: shard_map (90210)"]
    # by the lab's name (letters and digits compared), or by --canvas-assignment: the whole
    # title, or the title without its id
    for title in (None, "Lab 4: shard_map (90210)", "lab 4: SHARD_MAP"):
        assert canvas.column(export, "lab4-shard-map", title) == "Lab 4: shard_map (90210)"
    assert canvas.column(export, "lab4-shard-map", "Lab 3: parallelism") == \
        "Lab 3: parallelism (90209)"
    gradebook.write_canvas(tmp_path, frame(), canvas.column(export, "lab4-shard-map"),
                           gradebook.read_canvas_roster(export))
    with open(tmp_path / gradebook.CANVAS_FILE, newline="") as f:
        rows = list(csv.reader(f))
    # the exact title, so that Canvas's import finds the assignment by its (90210)
    assert rows[0] == ["Student", "ID", "SIS User ID", "SIS Login ID", "Section",
                       "Lab 4: shard_map (90210)"]
    assert {r[1]: r[5] for r in rows[2:]} == {"501": "1", "502": "2", "": "2"}


def test_a_canvas_export_none_of_whose_columns_match_is_refused_with_their_titles(tmp_path):
    from jaxlab.grade.output import canvas

    export = tmp_path / "canvas.csv"
    export.write_text(CANVAS_EXPORT)
    with pytest.raises(gradebook.BadCanvasRoster) as refused:
        canvas.column(export, "fixture")
    assert str(refused.value) == (
        f"--canvas-roster {export}: no assignment column matches this lab's name, 'fixture', so "
        "canvas_grades.csv would make a new assignment; its assignment columns are 'Lab 3: "
        "parallelism (90209)', 'Lab 4: shard_map (90210)': name the one to fill with "
        "--canvas-assignment TITLE")
    with pytest.raises(gradebook.BadCanvasRoster, match=r"no assignment column matches "
                                                        r"--canvas-assignment 'Lab 5'"):
        canvas.column(export, "lab4-shard-map", "Lab 5")
    # two assignments of one title (a re-created one keeps it): only the whole title picks
    export.write_text(CANVAS_EXPORT.replace("Lab 3: parallelism (90209)",
                                            "Lab 4: shard_map (90301)"))
    with pytest.raises(gradebook.BadCanvasRoster, match=r"matches 2 assignment columns \('Lab 4: "
                                                        r"shard_map \(90301\)', 'Lab 4: "):
        canvas.column(export, "lab4-shard-map")
    assert canvas.column(export, "x", "Lab 4: shard_map (90301)") == "Lab 4: shard_map (90301)"
    # no assignment column at all: nothing to fill
    export.write_text("Student,ID,SIS User ID,SIS Login ID,Section,Current Score\n")
    with pytest.raises(gradebook.BadCanvasRoster, match="has no assignment column"):
        canvas.column(export, "lab4-shard-map")


def test_a_file_that_is_not_a_canvas_export_is_refused(tmp_path):
    bad = tmp_path / "roster.csv"
    bad.write_text("name,email\nAnn,ann@x.edu\n")
    with pytest.raises(gradebook.BadCanvasRoster, match="not a Canvas gradebook export"):
        gradebook.read_canvas_roster(bad)


# --------------------------------------------------------------------------- similarity
HONEST = {
    "q1": ["y = jax.device_put(jnp.arange(8.0) * 2, NamedSharding(mesh, P('x')))",
           "vals = 2 * jnp.arange(8.0)\ny = jax.device_put(vals, NamedSharding(mesh, P('x')))",
           "y = jax.device_put(jnp.linspace(0, 14, 8), NamedSharding(mesh, P('x', None)))",
           "s = NamedSharding(mesh, P('x'))\ny = jax.device_put(jnp.array([2.0*i for i in "
           "range(8)]), s)"],
    "q2": ["def double(x):\n    return 2 * x", "def double(x):\n    return x + x",
           "double = lambda v: v * 2.0", "def double(arr):\n    out = arr * 2\n    return out"],
    "q3": ["def triple(x):\n    return 3 * x", "def triple(x):\n    return x + x + x",
           "triple = lambda v: v * 3.0", "def triple(arr):\n    return jnp.multiply(arr, 3)"],
}
OWN = [  # what a copier would keep: an idiosyncratic answer of one student
    "def double(x):\n    twice = jnp.multiply(x, 2.0)\n    checked = jnp.where(jnp.isfinite("
    "twice), twice, 0.0)\n    return checked.astype(x.dtype)",
    "def triple(values):\n    acc = jnp.zeros_like(values)\n    for _ in range(3):\n"
    "        acc = acc + values\n    return acc",
]


def rec(file, *answers):
    return Record(file=file, sha256="", answers={
        f"q{i + 1}": ["### Your code here\n" + a] for i, a in enumerate(answers)})


def test_a_renamed_copy_is_flagged_and_honest_students_sharing_answers_are_not():
    # honest students share answers: 4 ways to answer each question
    records = [rec(f"s{a}{b}{c}.ipynb", HONEST["q1"][a], HONEST["q2"][b], HONEST["q3"][c])
               for a in range(4) for b in range(4) for c in range(4) if (a + b + c) % 3 == 0]
    records.append(rec("own.ipynb", HONEST["q1"][1], OWN[0], OWN[1]))
    records.append(rec("half.ipynb", HONEST["q1"][1], OWN[0], HONEST["q3"][0]))
    copied = [OWN[0].replace("twice", "doubled").replace("checked", "safe"),
              OWN[1].replace("acc", "total").replace("values", "v")]
    records.append(rec("copy.ipynb", HONEST["q1"][1] + "\n# my own work", "\n" + copied[0],
                       "# summing three times\n\n" + copied[1]))
    template = {"q1": ["### Your code here\ny = ..."], "q2": ["### Your code here\ndouble = ..."],
                "q3": ["### Your code here\ntriple = ..."]}
    result = similarity.compare(records, template)
    flagged = {frozenset((p.a, p.b)) for p in result.flagged}
    assert flagged == {frozenset(("copy.ipynb", "own.ipynb"))}, [(p.a, p.b, p.score) for p in result.pairs]
    top = result.pairs[0]
    assert {"q2", "q3"} <= {m.question for m in top.matches}
    assert all(m.code > 0.8 for m in top.matches if m.question in ("q2", "q3"))
    # the starter line never counts: two blank answers share nothing
    assert similarity.strip_template(["### Your code here\ny = ..."],
                                     {"### Your code here", "y = ..."}) == ""
    html = similarity.section(result, lambda f: f"grading-summaries/{f}.txt")
    assert "<mark>" in html and "copy.ipynb" in html and 'data-flagged="1"' in html



IMPORT = "import jax.numpy as jnp"  # what every student writes atop every answer cell


def test_common_lines_are_those_at_least_half_of_a_questions_answers_have():
    answers = [f"{IMPORT}\ny = 1", f"{IMPORT}\ny = 2", f"{IMPORT}\nz = y\ny = 3", "", "y = 4",
               "y = 5"]
    assert similarity.common_lines(answers) == {IMPORT}  # 3 of the 5 answers
    assert similarity.common_lines(answers[:2]) == set()  # two students share nothing common


def test_the_page_highlights_neither_starter_code_nor_common_lines_and_lists_every_identical_answer(
        tmp_path):
    """The issue's class: an import atop every answer cell, a template line students keep,
    honest students sharing answers, and a verbatim copy of a student with two answers of her
    own and one the class commonly wrote."""
    def student(file, *answers):
        return Record(file=file, sha256="", answers={
            f"q{i + 1}": [f"### Your code here\n{IMPORT}\n" + a] for i, a in enumerate(answers)})

    records = [student(f"s{a}{b}{c}", HONEST["q1"][a], HONEST["q2"][b], HONEST["q3"][c])
               for a in range(4) for b in range(4) for c in range(4) if (a + b + c) % 3 == 0]
    records += [student("own", HONEST["q1"][1], OWN[0], OWN[1]),
                student("own-copy", HONEST["q1"][1], OWN[0], OWN[1])]
    # the starter code: q3's signature, which only "own" (and so her copy) kept as given
    template = {"q1": ["### Your code here\ny = ..."], "q2": ["### Your code here\ndouble = ..."],
                "q3": ["### Your code here\ndef triple(values):\n    ..."]}
    result = similarity.compare(records, template)
    assert [{p.a, p.b} for p in result.flagged] == [{"own", "own-copy"}]
    # the verbatim copy lists all three identical answers: q2 and q3 rare, then q1, which
    # many of the class wrote, marked common
    copy = result.flagged[0]
    assert [(m.question, m.common) for m in copy.matches][2] == ("q1", True)
    assert {m.question for m in copy.matches[:2]} == {"q2", "q3"}
    assert all(m.identical > 1 for m in copy.matches)
    assert copy.matches[2].words() == f"q1 (identical, common: {copy.matches[2].held()})"
    assert " q1 (common)," in similarity.write_csv(tmp_path, result).read_text()
    page = similarity.section(result, lambda f: f"grading-summaries/{f}.txt")
    marked = re.findall(r"<mark>(.*?)</mark>", page, re.S)
    assert marked and any("twice" in m for m in marked)  # the copied code is marked
    assert not any("import" in m or "def triple(values)" in m for m in marked), marked
    assert IMPORT in page  # shown, not marked
    # every listed pair, flagged or not, opens to its cells side by side
    assert sorted(map(int, re.findall(r'<details class="side" data-pair="(\d+)"', page))) == \
        list(range(len(result.pairs)))
    assert "identical, common: " in page and "A low score does not mean a pair worked alone" \
        in page

def test_traced_programs_alone_find_a_copy_whose_code_was_rewritten():
    bag = {"all_gather:f32[64,16]<-arg": 1, "dot_general:f32[4,16]<-all_gather,arg": 1,
           "shard_map:f32[32,16]<-arg,arg": 1}
    odd = {**bag, "ppermute:f32[4,16]<-dot_general": 3, "add:f32[4,16]<-ppermute,ppermute": 2}
    records = [Record(file=f"s{i}", sha256="", programs={
        "q3": bag, "q4": dict({f"mul:f32[{i}]<-arg": 1}, **bag), "q5": {"neg:f32[7]<-arg": 1}})
        for i in range(12)]
    copied = {"q3": odd, "q4": {"neg:f32[7]<-arg": 2}, "q5": {"exp:f32[7]<-arg": 1}}
    records += [Record(file="a", sha256="", programs=copied),
                Record(file="b", sha256="", programs=copied)]
    result = similarity.compare(records)
    assert {frozenset((p.a, p.b)) for p in result.flagged} == {frozenset("ab")}
    assert {m.question for m in result.pairs[0].matches} == {"q3", "q4", "q5"}
    assert result.pairs[0].matches[0].code is None and result.pairs[0].matches[0].trace == 1
