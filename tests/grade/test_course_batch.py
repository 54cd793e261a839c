"""The instructor's week on one real batch: Gradescope's export of the fixture assignment graded
with a late policy, the gradebook files (Canvas's column by its real title), the similarity
section in a real browser, one student regraded alone after an extension, a re-downloaded export
lacking graded folders, and bad input refused before anything is lost."""

import csv
import json
import pathlib
import re
import shutil

import pandas as pd
import pytest

from jaxlab.grade import grade
from jaxlab.grade.run.report import report, similar

from nbedit import answer_cell, write

pytestmark = pytest.mark.slow  # kernels, sandboxes or services: not in make test-quick

EXPORT = pathlib.Path(__file__).parent / "fixtures" / "gradescope_export"
SETTINGS = dict(workers=2, timeout=90, cell_timeout=30, memory_mb=1200, output_cap_mb=1)
POLICY = dict(deadline="2025-03-07 23:59 America/Los_Angeles", late_penalty="10%/day",
              grace="15m", late_cap="50%", cutoff="7d")
# five more students, one submission each (id, name, sid, submitted), in the export's own form
MORE_STUDENTS = [(4, "Eve Ng", "1005", "2025-03-06 10:00:00"),
                 (5, "Finn Ode", "1006", "2025-03-07 11:30:00"),
                 (6, "Gus Hale", "1007", "2025-03-07 18:00:00"),
                 (7, "Hana Ito", "1008", "2025-03-07 20:45:00"),
                 (8, "Ian Moss", "1009", "2025-03-07 23:30:00")]
MORE = "".join(
    f"submission_30100000{k}:\n  :submitters:\n  - :name: {name}\n    :sid: '{sid}'\n"
    f"    :email: {name.lower().replace(' ', '.')}@example.edu\n"
    f"  :created_at: {when}.000000000 -08:00\n  :score: 4.0\n  :status: processed\n"
    "  :history: []\n" for k, name, sid, when in MORE_STUDENTS)
# Eve's own way to each answer, and Finn's copy of it: names changed, a line split off, comments
EVE = {"y": 'y = jax.device_put(jnp.cumsum(jnp.full(8, 2.0)) - 2.0, NamedSharding(mesh, P("x")))',
       "double": "def double(x):\n    halves = [x, x]\n    return jnp.stack(halves).sum(axis=0)",
       "y_mean": "y_mean = float(jnp.sum(y) / y.shape[0])"}
FINN = {"y": '# start from twos\nbase = jnp.full(8, 2.0)\n\ny = jax.device_put(jnp.cumsum(base) - '
             '2.0, NamedSharding(mesh, P("x")))',
        "double": "def double(v):\n    # stack two copies and add them\n    parts = [v, v]\n"
                  "    return jnp.stack(parts).sum(axis=0)",
        "y_mean": "y_mean = float(jnp.sum(y) / y.shape[0])  # the average"}
# honest students' own ways: a class where the solution's answers are common but not universal
# (with six submissions, fifteen pairs, no pair can score above what 1% of shuffled classes reach)
HANA = {"y": 'vals = jnp.arange(0, 16, 2).astype(jnp.float32)\n'
             'y = jax.device_put(vals, NamedSharding(mesh, P("x")))'}
IAN = {"y": 'sharding = NamedSharding(mesh, P("x"))\n'
            'y = jax.device_put(jnp.linspace(0.0, 14.0, 8), sharding)',
       "double": "def double(x):\n    return x + x", "y_mean": "y_mean = float(y.mean())"}
WRONG = {"y": 'y = jax.device_put(jnp.zeros(8), NamedSharding(mesh, P("x")))',
         "double": "def double(x):\n    return 3 * x", "y_mean": "y_mean = 0.0"}


# what many students write atop every answer cell (the setup cell imports more: not the same)
IMPORT = "from jax.sharding import NamedSharding, PartitionSpec as P"


def with_answers(nb, answers):
    for name, source in answers.items():
        nb.cells[answer_cell(nb, name)].source = source
    for name in ("y", "double", "y_mean"):
        cell = nb.cells[answer_cell(nb, name)]
        cell.source = f"{IMPORT}\n{cell.source}"
    return nb


def files_under(folder):
    """Every path under ``folder`` (folders too), files with their bytes."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() if p.is_file() else None
            for p in sorted(folder.rglob("*"))}


@pytest.fixture(scope="module")
def week(lab, tmp_path_factory):
    base = tmp_path_factory.mktemp("week")
    root = base / "assignment_77_export"
    shutil.copytree(EXPORT, root)
    (root / "submission_metadata.yml").write_text(
        (root / "submission_metadata.yml").read_text() + MORE)
    solution = {}  # the solution's own answers
    made = {"submission_301000001": with_answers(lab.notebook(), solution),
            "submission_301000002": with_answers(lab.notebook(), WRONG),
            "submission_301000003": with_answers(lab.notebook(), solution),
            "submission_301000004": with_answers(lab.notebook(), EVE),
            "submission_301000005": with_answers(lab.notebook(), FINN),
            "submission_301000006": with_answers(lab.notebook(), solution),
            "submission_301000007": with_answers(lab.notebook(), HANA),
            "submission_301000008": with_answers(lab.notebook(), IAN),
            "submission_301000009": with_answers(lab.notebook(), solution),
            "submission_301000010": with_answers(lab.notebook(), solution)}
    for folder, nb in made.items():
        write(nb, root / folder / "fixture.ipynb")
    archive = shutil.make_archive(str(base / "export"), "zip", base, root.name)
    out = base / "grades"
    ok = grade(paths=[archive], output_dir=str(out), autograder=str(lab.autograder),
               template=str(lab.student), show=False, **SETTINGS, **POLICY)
    return {"ok": ok, "out": out, "archive": archive, "root": root,
            "df": pd.read_csv(out / "final_grades.csv", dtype={"sid": str})}


def row(df, name):
    return df[df["name"] == name].iloc[0]


def test_every_student_gets_a_row_with_name_sid_email_and_submission_time(week):
    assert week["ok"]
    df = week["df"]
    assert list(df.columns[:5]) == ["file", "name", "sid", "email", "submitted"]
    assert df.iloc[0]["file"] == "points-per-question"
    students = df.iloc[1:]
    assert sorted(students["name"]) == ["Ann Lee", "Bo Chen", "Cara Diaz", "Dev Patel", "Eve Ng",
                                        "Finn Ode", "Gus Hale", "Hana Ito", "Ian Moss",
                                        "José Núñez", "Zoë Ångström"]
    bo, cara = row(df, "Bo Chen"), row(df, "Cara Diaz")  # one group submission, two rows
    assert bo["file"] == cara["file"] == "submission_301000002/fixture.ipynb"
    assert (bo["sid"], bo["email"]) == ("1002", "bo.chen@example.edu")
    assert bo["submitted"] == "2025-03-08T02:15:00-08:00"
    assert float(row(df, "Ann Lee")["total_points_earned"]) == 4
    assert float(bo["total_points_earned"]) == 0
    zoe, jose = row(df, "Zoë Ångström"), row(df, "José Núñez")
    assert (zoe["sid"], zoe["submitted"]) == ("00421", "2025-03-08T07:40:12.938335+00:00")
    assert pd.isna(jose["sid"]) and jose["email"] == "jose.nunez@example.edu"


def test_late_penalties_are_applied_and_explained(week):
    df = week["df"]
    ann, dev, bo = row(df, "Ann Lee"), row(df, "Dev Patel"), row(df, "Bo Chen")
    assert (ann["late_penalty"], ann["final_score"], ann["late_reason"]) == (0, 4, "on time")
    # 11 minutes late, inside the 15-minute grace
    assert dev["final_score"] == 4 and "within the 15 min grace" in dev["late_reason"]
    assert bo["final_score"] == 0 and "1 day × 10%" in bo["late_reason"]
    # times in UTC ("... Z"): Zoë at 23:40 in Los Angeles, José at 01:30 the next morning
    assert row(df, "Zoë Ångström")["late_reason"] == "on time"
    jose = row(df, "José Núñez")
    assert jose["final_score"] == 3.6 and jose["late_reason"].startswith("1 h 31 min after")


def test_gradebook_files_parse_as_gradescope_and_canvas_read_them(week):
    gs = pd.read_csv(week["out"] / "gradescope_scores.csv", dtype={"SID": str})
    assert list(gs.columns) == ["Name", "SID", "Email", "Total Score", "Max Points"]
    assert len(gs) == 11 and gs.set_index("SID").loc["1001", "Total Score"] == 4
    assert gs.set_index("Name").loc["Zoë Ångström", "SID"] == "00421"
    with open(week["out"] / "canvas_grades.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["Student", "ID", "SIS User ID", "SIS Login ID", "Section", "fixture"]
    assert rows[1][0].strip() == "Points Possible" and float(rows[1][5]) == 4
    assert {r[2]: float(r[5]) for r in rows[2:]}["1004"] == 4
    assert {r[0]: r[2:4] for r in rows[2:]}["José Núñez"] == ["", "jose.nunez@example.edu"]


CANVAS_EXPORT = (
    "Student,ID,SIS User ID,SIS Login ID,Section,Lab 3: parallelism (90209),"
    "Lab 4: shard_map (90210),Labs Current Score,Current Score\n"
    "    Points Possible,,,,,20.00,4.00,(read only),(read only)\n"
    '"Lee, Ann",501,1001,alee,CS 101,18,,90,90\n'
    '"Ångström, Zoë",509,00421,zangstrom,CS 101,20,,100,100\n')


def test_canvas_grades_fill_the_canvas_exports_own_column_or_change_nothing(week, tmp_path):
    out = tmp_path / "grades"
    shutil.copytree(week["out"], out)
    export = tmp_path / "canvas_export.csv"
    export.write_text(CANVAS_EXPORT)
    before = files_under(out)
    # the fixture lab is named "fixture": no column of this course's gradebook is titled so
    with pytest.raises(ValueError) as refused:
        report(output_dir=str(out), canvas_roster=str(export), show=False)
    assert str(refused.value) == (
        f"--canvas-roster {export}: no assignment column matches this lab's name, 'fixture', so "
        "canvas_grades.csv would make a new assignment; its assignment columns are 'Lab 3: "
        "parallelism (90209)', 'Lab 4: shard_map (90210)': name the one to fill with "
        "--canvas-assignment TITLE")
    assert files_under(out) == before
    assert report(output_dir=str(out), canvas_roster=str(export),
                  canvas_assignment="Lab 4: shard_map", show=False)
    for _ in range(2):  # and again with what the folder kept
        with open(out / "canvas_grades.csv", newline="") as f:
            rows = list(csv.reader(f))
        assert rows[0] == ["Student", "ID", "SIS User ID", "SIS Login ID", "Section",
                           "Lab 4: shard_map (90210)"]
        got = {r[0]: r for r in rows[2:]}
        assert got["Ångström, Zoë"] == ["Ångström, Zoë", "509", "00421", "zangstrom", "CS 101",
                                         "4"]
        assert len(rows) == 13
        assert report(output_dir=str(out), show=False)


def test_a_redownloaded_export_lacking_graded_folders_keeps_their_rows(week, tmp_path, capsys):
    out = tmp_path / "grades"
    shutil.copytree(week["out"], out)
    before = pd.read_csv(out / "final_grades.csv", dtype={"sid": str}).set_index("name")
    # downloaded again: Dev Patel's folder missing (his entry still listed), Zoë's entry and
    # folder both gone
    root = tmp_path / "again" / week["root"].name
    shutil.copytree(week["root"], root)
    for folder in ("submission_301000003", "submission_301000009"):
        shutil.rmtree(root / folder)
    meta = root / "submission_metadata.yml"
    text = meta.read_text()
    meta.write_text(text[:text.index("submission_301000009:")] +
                    text[text.index("submission_301000010:"):])
    archive = shutil.make_archive(str(tmp_path / "again"), "zip", root.parent, root.name)
    capsys.readouterr()
    assert grade(paths=[archive], output_dir=str(out), autograder=str(_autograder(out)),
                 show=False, **SETTINGS)
    said = [line for line in capsys.readouterr().err.splitlines() if "not in this export" in line]
    assert said == [
        "jaxlab grade: Dev Patel (submission_301000003): not in this export; graded before, so "
        "the row stays in final_grades.csv, gradescope_scores.csv and canvas_grades.csv, marked "
        "in grading_status",
        "jaxlab grade: Zoë Ångström (submission_301000009): not in this export; graded before, "
        "so the row stays in final_grades.csv, gradescope_scores.csv and canvas_grades.csv, "
        "marked in grading_status"]
    for run in ("grade", "report"):
        df = pd.read_csv(out / "final_grades.csv", dtype={"sid": str}).set_index("name")
        assert sorted(df.index[1:]) == sorted(before.index[1:]), run
        for name in before.index[1:]:
            kept = name in ("Dev Patel", "Zoë Ångström")
            assert df.loc[name, "grading_status"].startswith(
                "not in the latest export: graded from an earlier one, kept") == kept, run
            assert df.loc[name, "final_score"] == before.loc[name, "final_score"]
            assert df.loc[name, "late_reason"] == before.loc[name, "late_reason"]
        gs = pd.read_csv(out / "gradescope_scores.csv", dtype={"SID": str})
        assert len(gs) == 11 and gs.set_index("Name").loc["Dev Patel", "Total Score"] == 4
        assert len(pd.read_csv(out / "canvas_grades.csv", skiprows=[1])) == 11
        assert report(output_dir=str(out), show=False)


def test_records_keep_answers_and_traced_programs_for_the_report(week):
    records = [json.loads(p.read_text()) for p in (week["out"] / ".jaxlab" / "records").glob("*")]
    eve = next(r for r in records if r["file"].startswith("submission_301000004"))
    assert set(eve["answers"]) == {"q1", "q2", "q3"}
    assert any("halves" in cell for cell in eve["answers"]["q2"])
    assert any(k.startswith("stack") or k.startswith("reduce_sum")
               for k in eve["programs"]["q2"]), eve["programs"]
    assert sum(len(json.dumps(r["answers"])) + len(json.dumps(r["programs"]))
               for r in records) / len(records) < 20_000


def test_the_copy_is_the_one_flagged_pair_with_its_cells_side_by_side(week, tmp_path):
    import matplotlib.image

    import browser

    page = week["out"] / "report.html"
    tree = browser.dom(page)
    pairs = (week["out"] / "similar_pairs.csv").read_text()
    assert 'id="similar"' in tree and 'data-similar-pairs="1"' in tree, pairs
    flagged = [line for line in tree.split("<tr") if 'data-flagged="1"' in line]
    assert len(flagged) == 1 and "submission_301000004" in flagged[0] \
        and "submission_301000005" in flagged[0]
    assert "(Eve Ng)" in flagged[0] and "(Finn Ode)" in flagged[0]  # the roster's students
    assert "<mark>" in tree and "halves" in tree and "parts" in tree
    # the import atop every answer cell is shown, never marked; every listed pair opens to its
    # cells; identical solution notebooks list their answers, marked common
    marked = re.findall(r"<mark>(.*?)</mark>", tree, re.S)
    assert IMPORT in tree and not any("import" in m for m in marked), marked
    listed = len(re.findall(r"<tr data-pair=", tree))
    assert listed == 10 and len(re.findall(r'<details class="side"', tree)) == listed
    same = [r for r in re.findall(r"<tr data-pair=.*?</tr>", tree, re.S)
            if "(Ann Lee)" in r and "(Dev Patel)" in r]
    assert len(same) == 1 and sorted(re.findall(
        r"(q\d) \(identical, common: \d+ of 10 answers\)", same[0])) == ["q1", "q2", "q3"], same
    assert "A low score does not mean a pair worked alone" in tree
    png = browser.screenshot(page, tmp_path / "similar.png", height=2600)
    shutil.copy(png, week["out"] / "similar-screenshot.png")
    assert matplotlib.image.imread(png).std() > 0.05
    result = similar(output_dir=str(week["out"]), show=False)
    assert [{p.a.split("/")[0], p.b.split("/")[0]} for p in result.flagged] == \
        [{"submission_301000004", "submission_301000005"}]


def test_one_student_regraded_after_an_extension_and_the_rest_untouched(week, tmp_path):
    out = week["out"]
    records = out / ".jaxlab" / "records"
    before = {p.name: p.stat().st_mtime_ns for p in records.glob("*.json")}
    ext = tmp_path / "extensions.csv"
    ext.write_text("email,extension\nbo.chen@example.edu,1d\n")
    assert grade(paths=[week["archive"]], output_dir=str(out), autograder=str(_autograder(out)),
                 only=["Cara Diaz"], extensions=str(ext), show=False, **SETTINGS)
    after = {p.name: p.stat().st_mtime_ns for p in records.glob("*.json")}
    changed = [n for n in after if after[n] != before[n]]
    assert len(changed) == 1
    assert json.loads((records / changed[0]).read_text())["file"].startswith(
        "submission_301000002")
    df = pd.read_csv(out / "final_grades.csv", dtype={"sid": str})
    # the group's deadline is its most generous member's: on time for Bo and Cara now
    assert row(df, "Cara Diaz")["late_reason"].startswith("on time (extended deadline")


def test_bad_input_is_one_sentence_and_loses_nothing(week, tmp_path):
    out = week["out"]
    csv_before = (out / "final_grades.csv").read_text()
    with pytest.raises(ValueError, match="has no time zone"):
        report(output_dir=str(out), deadline="2025-03-07 23:59", show=False)
    ghost = tmp_path / "ext.csv"
    ghost.write_text("sid,extension\n9999,2d\n")
    with pytest.raises(ValueError, match=r"ext.csv, line 2: no submitter has sid '9999'"):
        report(output_dir=str(out), extensions=str(ghost), show=False)
    with pytest.raises(ValueError, match="--only nobody: no submission"):
        grade(paths=[week["archive"]], output_dir=str(out), only=["nobody"], show=False,
              autograder=str(_autograder(out)), **SETTINGS)
    # the export downloaded again, a key of line n broken: refused by the zip's name, the
    # entry and the line, the export copy regrades read left as it was
    kept = files_under(out / ".jaxlab" / "export")
    root = tmp_path / "broken" / week["root"].name
    shutil.copytree(week["root"], root)
    meta = root / "submission_metadata.yml"
    lines = meta.read_text().splitlines(keepends=True)
    n = lines.index("    :email: jose.nunez@example.edu\n") + 1
    lines[n - 1] = "    :email jose.nunez@example.edu\n"
    meta.write_text("".join(lines))
    broken = shutil.make_archive(str(tmp_path / "broken"), "zip", root.parent, root.name)
    with pytest.raises(ValueError) as refused:
        grade(paths=[broken], output_dir=str(out), show=False,
              autograder=str(_autograder(out)), **SETTINGS)
    assert str(refused.value).startswith(
        f"{broken}: {root.name}/submission_metadata.yml is not valid YAML at line {n}: ")
    assert files_under(out / ".jaxlab" / "export") == kept
    assert (out / "final_grades.csv").read_text() == csv_before


def test_a_folder_graded_before_the_course_files_existed_still_reports(week, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(week["out"], old, ignore=shutil.ignore_patterns("export"))
    state = old / ".jaxlab"
    for name in ("roster.json", "late-policy.json", "template.ipynb"):
        (state / name).unlink()
    for name in ("final_grades.csv", "report.html", "gradescope_scores.csv", "canvas_grades.csv",
                 "similar_pairs.csv"):
        (old / name).unlink()
    for path in (state / "records").glob("*.json"):  # records as an older jaxlab wrote them
        raw = json.loads(path.read_text())
        del raw["answers"], raw["programs"]
        path.write_text(json.dumps(raw))
    assert report(output_dir=str(old), show=False)
    df = pd.read_csv(old / "final_grades.csv")
    assert list(df.columns) == ["file", "q1", "q2", "q3", "total_points_earned",
                                "percent_correct", "grading_status"]
    assert len(df) == 11 and df["total_points_earned"].iloc[1:].max() == 4
    page = (old / "report.html").read_text()
    assert "what the class got wrong" in page and 'id="similar"' not in page
    assert not (old / "gradescope_scores.csv").exists()
    with pytest.raises(ValueError, match="keep no answers to compare"):
        similar(output_dir=str(old), show=False)


def _autograder(out):
    (zip_path,) = (out / ".jaxlab" / "autograder").glob("*.zip")
    return zip_path
