import os

import pytest

from labs import release_paths

# The checks rebuild shardings on 8 devices; set before JAX starts in this process.
os.environ.setdefault("PJRT_NPROC", "16")
import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)


@pytest.fixture(scope="session", autouse=True)
def jaxlab_cache(tmp_path_factory):
    """What `jaxlab grade` keeps between batches (warmed compilation caches) goes here, not
    into ~/.cache/jaxlab: every test run warms from scratch, once (the test processes of one
    run share it: the warm-up holds a lock, as the shards on one node do)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # the run's folder, above each worker's own
    path = base / "jaxlab-cache"
    path.mkdir(exist_ok=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JAXLAB_CACHE_DIR", str(path))
        yield path


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``-n 2 --dist loadgroup``: `make test PYTEST_PROCESSES=2`) the tests of one
    file go to one process, so its module fixtures (a graded batch, a kernel) are built once;
    the answer corpus goes by lab, one kernel per lab."""
    for item in items:
        if item.get_closest_marker("xdist_group"):
            continue
        group = item.nodeid.split("::")[0]
        answer = item.callspec.params.get("answer") if hasattr(item, "callspec") else None
        lab = item.callspec.params.get("lab") if hasattr(item, "callspec") else None
        claim = item.callspec.params.get("claim") if hasattr(item, "callspec") else None
        claim = claim if isinstance(claim, tuple) else None  # (lab, id); none while empty
        if group.endswith(("test_answers.py", "test_claims.py")) and \
                (answer is not None or lab is not None or claim is not None):
            lab = answer.lab if answer is not None else claim[0] if claim is not None else lab
            group = f"answers-{lab}"  # one kernel per lab: its solution run serves both
        elif group.endswith("test_grading_paths.py"):  # reads the corpus's verdicts
            group = f"answers-{item.callspec.params['graded_paths']}"
        item.add_marker(pytest.mark.xdist_group(group))


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
    from jaxlab import corpus

    cache, harnesses = {}, {}

    def harness(lab):
        if lab not in harnesses:
            harnesses[lab] = corpus.LabHarness(
                lab, tmp_path_factory.mktemp(lab), tmp_path_factory.mktemp(f"{lab}-jax-cache"))
        return harnesses[lab]

    def verdict(answer):
        if answer.id not in cache:
            # an answer replays only what its own question reads, and a wrong authored answer
            # also what the later questions it declares to cost read (much less for an answer
            # whose names later cells use: Lab 7's training run, Lab 5's pipeline and MoE
            # layer); with JAXLAB_CORPUS_REPLAY=all a wrong authored answer replays every later
            # question it could cost (test_answer_leaves_the_other_questions_as_declared then
            # also sees a loss it does not declare)
            if answer.blind or answer.correct:
                only = {answer.question}
            elif os.environ.get("JAXLAB_CORPUS_REPLAY") == "all":
                only = None
            else:
                only = {answer.question, *answer.other_questions_lose}
            cache[answer.id] = harness(answer.lab).grade(answer, only=only)
        return cache[answer.id]

    verdict.harnesses = harnesses
    verdict.harness = harness  # the lab's kernel holding its solution run
    yield verdict
    for h in harnesses.values():
        h.close()


CORPUS = []  # (lab, question, correct, full marks) of every answer graded in this run


def pytest_runtest_logreport(report):
    """Collects the corpus outcomes test_answers records (from every xdist process too)."""
    if report.when == "call":
        CORPUS.extend(tuple(v) for k, v in report.user_properties if k == "corpus")


def pytest_terminal_summary(terminalreporter, config):
    """Print the answer corpus's confusion table and keep a copy under pytest's tmp dir."""
    if not CORPUS:
        return
    from jaxlab import corpus

    authored = [r[:4] for r in CORPUS if not r[4]]
    blind = [r[:4] for r in CORPUS if r[4]]
    lines = corpus.confusion_table(authored) if authored else []
    if blind:
        lines += ["", "blind answers (tests/answers/<lab>/blind/):", *corpus.confusion_table(blind)]
    lines += ["", "public checks (grader.check) on the wrong answers, per lab:",
              *corpus.public_flag_table([(r[0], r[2], r[5]) for r in CORPUS])]
    terminalreporter.section("answer corpus: confusion table")
    for line in lines:
        terminalreporter.write_line(line)
    factory = getattr(config, "_tmp_path_factory", None)
    if factory is not None:
        path = factory.getbasetemp() / "confusion_table.txt"
        path.write_text("\n".join(lines) + "\n")
        terminalreporter.write_line(f"(written to {path})")
