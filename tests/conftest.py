import os
import sys

import pytest

from labs import release_paths

# The checks rebuild shardings on 8 devices; set before JAX starts in this process.
os.environ.setdefault("PJRT_NPROC", "16")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


@pytest.fixture(scope="session", autouse=True)
def jaxlab_cache(tmp_path_factory):
    """What `jaxlab grade` keeps between batches (warmed compilation caches) goes here, not
    into ~/.cache/jaxlab: every test run warms from scratch."""
    with pytest.MonkeyPatch.context() as mp:
        path = tmp_path_factory.mktemp("jaxlab-cache")
        mp.setenv("JAXLAB_CACHE_DIR", str(path))
        yield path


@pytest.fixture(scope="session")
def release_build(tmp_path_factory):
    """build(lab, colab_url=None) -> (student dir, zip, solution) from the master, made once per
    session for each (lab, badge URL): several release tests compare against the same build."""
    from jaxlab import release
    from labs import ROOT

    builds = {}

    def build(lab, colab_url=None):
        if (lab, colab_url) not in builds:
            workdir = tmp_path_factory.mktemp(f"release-{lab}")
            builds[lab, colab_url] = release._generate(ROOT, lab, workdir, colab_url=colab_url)
        return builds[lab, colab_url]

    return build


@pytest.fixture(scope="session")
def lab3():
    return release_paths("lab3-parallelism")


@pytest.fixture(scope="session")
def graded(tmp_path_factory):
    """grade(answer) -> Verdict from the answer harness, one kernel per lab, each answer once."""
    import answers_harness

    cache, harnesses = {}, {}

    def verdict(answer):
        if answer.id not in cache:
            lab = answer.lab
            if lab not in harnesses:
                harnesses[lab] = answers_harness.LabHarness(lab, tmp_path_factory.mktemp(lab))
            cache[answer.id] = harnesses[lab].grade(answer)
            answers_harness.GRADED.append(cache[answer.id])
        return cache[answer.id]

    verdict.harnesses = harnesses
    yield verdict
    for h in harnesses.values():
        h.close()


def pytest_terminal_summary(terminalreporter, config):
    """Print the answer corpus's confusion table and keep a copy under pytest's tmp dir."""
    harness = sys.modules.get("answers_harness")
    if harness is None or not harness.GRADED:
        return
    lines = harness.confusion_table(harness.GRADED)
    terminalreporter.section("answer corpus: confusion table")
    for line in lines:
        terminalreporter.write_line(line)
    factory = getattr(config, "_tmp_path_factory", None)
    if factory is not None:
        path = factory.getbasetemp() / "confusion_table.txt"
        path.write_text("\n".join(lines) + "\n")
        terminalreporter.write_line(f"(written to {path})")
