"""docs/kubernetes.md: its manifests parse, and the Indexed Job's command, run here with
JOB_COMPLETION_INDEX set and its volumes mapped onto local folders, grades its shard; the report
Job's command then merges what is there."""

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pandas as pd
import pytest
import yaml

from jaxlab.grade.run.shard import shard_of

from nbedit import answer_cell, write

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "kubernetes.md"


def manifests():
    blocks = re.findall(r"```yaml\n(.*?)```", DOC.read_text(), re.S)
    docs = [d for b in blocks for d in yaml.safe_load_all(b) if d]
    return {d["metadata"]["name"]: d for d in docs}


def container(job):
    (c,) = job["spec"]["template"]["spec"]["containers"]
    return c


def test_the_manifests_are_an_indexed_grade_job_and_a_report_job_with_what_bwrap_needs():
    jobs = manifests()
    grade, report = jobs["jaxlab-grade"], jobs["jaxlab-report"]
    assert grade["kind"] == report["kind"] == "Job"
    spec = grade["spec"]
    assert spec["completionMode"] == "Indexed"
    c = container(grade)
    command = " ".join(c["command"] + c["args"])
    assert f'--shard "$JOB_COMPLETION_INDEX/{spec["completions"]}"' in command
    assert "--sandbox require" in command
    sc = c["securityContext"]
    assert sc["seccompProfile"]["type"] == sc["appArmorProfile"]["type"] == "Unconfined"
    assert sc["procMount"] == "Unmasked" and spec["template"]["spec"]["hostUsers"] is False
    assert "privileged" not in sc
    # both Jobs mount the same claim where the commands read and write
    claims = {name: {v["name"]: v.get("persistentVolumeClaim", {}).get("claimName")
                     for v in job["spec"]["template"]["spec"]["volumes"]}
              for name, job in jobs.items()}
    assert claims["jaxlab-grade"]["grading"] == claims["jaxlab-report"]["grading"]
    out = re.search(r"-o (\S+)", command)[1]
    assert container(report)["args"] == [f"exec jaxlab report {out}"]


@pytest.mark.slow  # grades a shard: kernels in the sandbox
def test_the_indexed_jobs_command_run_here_grades_its_shard(lab, tmp_path):
    jobs = manifests()
    grade, report = jobs["jaxlab-grade"], jobs["jaxlab-report"]
    count = grade["spec"]["completions"]
    c = container(grade)
    mounts = {m["mountPath"]: tmp_path / m["name"] for m in c["volumeMounts"]}

    def here(text):
        for there, local in mounts.items():
            text = text.replace(there, str(local))
        return text

    grading = mounts["/grading"]
    subs = grading / "submissions"
    sol = lab.notebook
    names = ["solution.ipynb", "blank.ipynb"] + [f"wrong-{k}.ipynb" for k in range(6)]
    for name in names:
        nb = sol()
        if name != "solution.ipynb":
            nb.cells[answer_cell(nb, "double")].source = "def double(x):\n    return 3 * x"
        write(nb, subs / name)
    shutil.copy(lab.autograder, grading / "autograder.zip")
    shutil.copy(lab.solution, grading / "solution.ipynb")
    index = shard_of("solution.ipynb", count)  # an index that holds a submission
    mine = {n for n in names if shard_of(n, count) == index}
    assert 0 < len(mine) < len(names)

    env = {**os.environ, "PATH": f"{pathlib.Path(sys.executable).parent}:{os.environ['PATH']}",
           "JOB_COMPLETION_INDEX": str(index),
           **{e["name"]: here(e["value"]) for e in c.get("env", [])}}
    for local in mounts.values():
        local.mkdir(exist_ok=True)
    done = subprocess.run(c["command"] + [here(a) for a in c["args"]], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = grading / "grades"
    records = {json.loads(p.read_text())["file"]
               for p in (out / ".jaxlab" / "records").glob("*.json")}
    assert records == mine
    assert f"shard {index}/{count} holds {len(mine)} of the {len(names)}" in done.stderr

    r = container(report)
    done = subprocess.run(r["command"] + [here(a) for a in r["args"]], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-3000:]  # the other shards never ran
    assert f"{len(mine)} of {len(mine)} submissions graded so far" in done.stderr
    others = ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in
                       ((0, index - 1), (index + 1, count - 1)) if b >= a)
    assert f"shards {others} of {count}: never started" in done.stderr
    df = pd.read_csv(out / "final_grades.csv")
    assert set(df["file"]) == {"points-per-question"} | mine
