"""What the labs say JAX and XLA do is measured, and re-measured here (docs/claims.md).

A cell of a lab that shows a claim carries the tag ``claim:<id>`` and prints what it measures
on the notebook's own sizes; ``tests/claims/<lab>.py`` maps each id to a check of that printed
text (it raises AssertionError unless the numbers support the claim as the text states it); and
``docs/claims.md`` lists each claim with its cell and its test. The checks read the printed
output of the solution's run in the answer harness's kernel (one run per lab, shared with
test_answers.py), so a JAX or XLA that makes a claim false fails here.
"""

import importlib.util
import re

import pytest

from jaxlab import corpus as harness
from labs import ROOT

DOC = ROOT / "docs" / "claims.md"
ROW = re.compile(r"^\|\s*`([a-z0-9][a-z0-9-]*)`\s*\|", re.M)


def registry(lab):
    """The lab's ``CLAIMS`` ({id: check}) from tests/claims/<lab>.py; {} when it has none."""
    path = ROOT / "tests" / "claims" / f"{lab}.py"
    if not path.exists():
        return {}
    spec = importlib.util.spec_from_file_location(f"claims_{lab.replace('-', '_')}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return dict(module.CLAIMS)


def documented():
    """lab -> the claim ids of its section of docs/claims.md (``## <lab>``)."""
    sections = re.split(r"^## ", DOC.read_text(), flags=re.M)[1:] if DOC.exists() else []
    return {s.split("\n", 1)[0].strip(): ROW.findall(s) for s in sections}


LABS = harness.labs()
CLAIMS = [(lab, cid) for lab in LABS for cid in sorted(registry(lab))]


@pytest.mark.parametrize("lab", LABS)
def test_each_claim_is_listed_shown_by_a_cell_and_tested(lab):
    docs = documented().get(lab, [])
    assert len(docs) == len(set(docs)), f"a claim id repeats in docs/claims.md: {docs}"
    cells = harness.Release(lab).claim_cells
    tested = registry(lab)
    assert set(docs) == set(cells) == set(tested), (
        f"{lab}: in docs/claims.md {sorted(docs)}; tagged cells {sorted(cells)}; "
        f"tests/claims/{lab}.py {sorted(tested)}")
    assert all(cid.startswith(lab.split("-")[0] + "-") for cid in docs), \
        "claim ids start with their lab, e.g. lab4-fsdp-gathers"


@pytest.mark.slow
@pytest.mark.parametrize("claim", CLAIMS, ids=[f"{lab}/{cid}" for lab, cid in CLAIMS])
def test_claim_holds_in_the_solutions_own_run(claim, graded):
    lab, cid = claim
    h = graded.harness(lab)
    index = h.release.claim_cells[cid]
    assert (index, None) not in h.solution_errors and \
        not any(i == index for i, _ in h.solution_errors), f"the cell of {cid} raised"
    text = h.solution_outputs.get(index, "")
    assert text.strip(), f"the cell of {cid} printed nothing"
    registry(lab)[cid](text)
