"""Read docs/requirements.md: per lab, one row per requirement a task's text states, with what
exercises it in the hidden checks (see the format at the top of that file).

Shared by tests/test_requirements.py; a new lab's section is read the same way.
"""

import dataclasses
import functools
import importlib
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
REQUIREMENTS = ROOT / "docs" / "requirements.md"
ANSWERS = ROOT / "tests" / "answers"
COLUMNS = ("task", "requirement (text)", "checked by", "exercised by", "readings accepted",
           "violating corpus answer")
SECTION = re.compile(r"^## Lab (\d+) \(`src/jaxlab/checks/(lab\d+)\.py`\)", re.M)
NAME = re.compile(r"`([^`]+)`")


@dataclasses.dataclass(frozen=True)
class Claim:
    """One item of the "exercised by" column."""
    kind: str  # "cases" (a constant of fresh cases), "read" (a graded variable), "trace"
    text: str
    constant: str | None = None
    field: str | None = None
    values: tuple = ()  # the values the row says the cases take (as written)


@dataclasses.dataclass(frozen=True)
class Row:
    lab: str  # checks module name: "lab5"
    line: int  # in docs/requirements.md
    task: str  # "q6"
    requirement: str
    checked_by: str
    claims: tuple
    violating: tuple  # wrong answers named
    accepted: tuple  # correct answers named after "accepted:"

    def where(self):
        return f"docs/requirements.md:{self.line} ({self.lab} {self.task})"


class FormatError(ValueError):
    pass


def _cells(line):
    return [c.strip() for c in line.strip().strip("|").split("|")]


def parse_claims(text):
    """The items of an "exercised by" cell, separated by ';'."""
    claims = []
    for item in (i.strip() for i in text.split(";")):
        if not item:
            continue
        if item.startswith("trace:"):
            claims.append(Claim("trace", item))
            continue
        if item.startswith("read:"):
            names = NAME.findall(item)
            if not names:
                raise FormatError(f"'{item}': read: names a graded variable in backticks")
            claims.extend(Claim("read", item, constant=n) for n in names)
            continue
        match = re.fullmatch(r"`([A-Z][A-Z0-9_]*)`(?:\s+([A-Za-z_]\w*))?(?:\s*=\s*(.+))?", item)
        if not match:
            raise FormatError(f"'{item}': expected `CONSTANT` [field] [= v1, v2, ...], "
                              "read: `variable` or trace: words")
        constant, field, values = match.groups()
        values = tuple(v.strip() for v in values.split(",")) if values else ()
        claims.append(Claim("cases", item, constant, field, values))
    return tuple(claims)


def _answers(text):
    """(wrong answers, accepted answers) named in the last column."""
    wrong, _, accepted = text.partition("accepted:")
    return tuple(NAME.findall(wrong)), tuple(NAME.findall(accepted))


def rows(text=None):
    """Every table row of every lab section."""
    text = REQUIREMENTS.read_text() if text is None else text
    found = []
    sections = list(SECTION.finditer(text))
    for k, section in enumerate(sections):
        lab = section.group(2)
        end = sections[k + 1].start() if k + 1 < len(sections) else len(text)
        header = None
        first_line = text.count("\n", 0, section.start()) + 1
        for offset, line in enumerate(text[section.start():end].splitlines()):
            if not line.startswith("|"):
                header = None
                continue
            cells = _cells(line)
            if header is None:
                header = cells
                if tuple(header) != COLUMNS:
                    raise FormatError(f"docs/requirements.md:{first_line + offset}: columns "
                                      f"{header}, expected {list(COLUMNS)}")
                continue
            if set(line.replace("|", "").strip()) <= set("-: "):
                continue
            if len(cells) != len(COLUMNS):
                raise FormatError(f"docs/requirements.md:{first_line + offset}: {len(cells)} "
                                  f"cells, expected {len(COLUMNS)}")
            task, requirement, checked_by, exercised, _, answers = cells
            wrong, accepted = _answers(answers)
            found.append(Row(lab, first_line + offset, task, requirement, checked_by,
                             parse_claims(exercised), wrong, accepted))
    return found


def checks_module(lab):
    return importlib.import_module(f"jaxlab.checks.{lab}")


def question_of(module, task):
    """The question key ("q6_bubble") of a task column ("q6")."""
    keys = [q for q in module.QUESTIONS if q.split("_")[0] == task]
    return keys[0] if len(keys) == 1 else None


def corpus_folder(lab):
    folders = [p for p in ANSWERS.iterdir() if p.is_dir() and p.name.split("-")[0] == lab]
    return folders[0] if len(folders) == 1 else None


def values_of(constant, field):
    """The values a fresh-case constant takes: its items' ``field`` (attribute or key), its
    items themselves, or the constant itself when it is a single value."""
    items = constant if isinstance(constant, (tuple, list)) else (constant,)
    if field is None:
        return list(items)
    out = []
    for item in items:
        if isinstance(item, dict) and field in item:
            out.append(item[field])
        elif hasattr(item, field):
            out.append(getattr(item, field))
        else:
            raise FormatError(f"{type(item).__name__} has no field {field!r}")
    return out


def written(value):
    """A value as a row writes it (0.1, 11, True, 'x')."""
    return repr(value) if isinstance(value, str) else str(value)


# "any" in a requirement: a size the text lets vary (a student's own choice, such as a mesh
# axis's name, goes under "readings accepted" instead)
VARIES = re.compile(r"\bany\b", re.I)


@functools.lru_cache(maxsize=None)
def _corpus(lab):
    from jaxlab import corpus

    folder = corpus_folder(lab)
    return tuple(corpus.load_answers(folder.name)) if folder else ()


def corpus_answers(row):
    """(wrong, correct) answer names of the row's question in tests/answers."""
    question = question_of(checks_module(row.lab), row.task)
    answers = [a for a in _corpus(row.lab) if a.question == question]
    return ({a.name for a in answers if not a.correct}, {a.name for a in answers if a.correct})


def problems(row):
    """What is wrong with a row: names that resolve to nothing, claims the checks module does
    not bear out, a requirement that nothing exercises. Empty when the row holds."""
    out = []
    module = checks_module(row.lab)
    question = question_of(module, row.task)
    if not question:
        return [f"no question {row.task} in {row.lab}.QUESTIONS"]
    if not row.claims:
        out.append("nothing exercises this requirement (the 'exercised by' cell is empty)")
    source = pathlib.Path(module.__file__).read_text()
    varied = False
    for claim in row.claims:
        if claim.kind == "read":
            if claim.constant not in module.QUESTIONS[question].names:
                out.append(f"{claim.constant} is not a graded variable of {question}")
        elif claim.kind == "trace":
            if not claim.text.removeprefix("trace:").strip():
                out.append("an empty trace: item")
            if not row.violating:
                out.append("a traced fact needs a wrong answer that violates it, to show that "
                           "the check reads it")
        elif not hasattr(module, claim.constant):
            out.append(f"{row.lab} has no {claim.constant}")
        elif len(re.findall(rf"\b{claim.constant}\b", source)) < 2:
            out.append(f"{claim.constant} is defined but never used")
        else:
            try:
                have = {written(v) for v in values_of(getattr(module, claim.constant),
                                                      claim.field)}
            except FormatError as exc:
                out.append(f"{claim.constant}: {exc}")
                continue
            missing = [v for v in claim.values if v not in have]
            if missing:
                out.append(f"no case of {claim.constant} has {claim.field or 'value'} "
                           f"{', '.join(missing)} (they have {', '.join(sorted(have))})")
            varied |= len(set(claim.values)) >= 2
    if VARIES.search(row.requirement) and not varied:
        out.append("the text lets a size vary ('any'), but no fresh-case constant is named "
                   "with two values or more of it")
    wrong, correct = corpus_answers(row)
    if not row.violating:
        out.append("no wrong answer in the corpus is named as violating it")
    out += [f"{name} is not a wrong answer of {question} in the corpus"
            for name in row.violating if name not in wrong]
    out += [f"{name} is not a correct answer of {question} in the corpus"
            for name in row.accepted if name not in correct]
    return out
