"""Open an otter autograder zip: its questions, points, support files and jaxlab checks module."""

import ast
import dataclasses
import hashlib
import json
import pathlib
import zipfile

from otter.nbmeta_config import NBMetadataConfig
from otter.run.run_autograder.autograder_config import AutograderConfig
from otter.test_files import create_test_file

import jaxlab

CHECKS_FILE_GLOB = "jaxlab_*.py"
FORM_MODULE = "jaxlab_form"
# a checks module declares ``JAXLAB_CHECKS = 1`` beside its QUESTIONS, probe and verdict
CHECKS_MARKER = "JAXLAB_CHECKS"


@dataclasses.dataclass
class Autograder:
    root: pathlib.Path  # the extracted zip; only trusted processes read it
    tests: dict  # question -> otter TestFile, parsed from tests/<q>.py
    checks_module: str | None  # e.g. "jaxlab_lab3"; None for a generic otter zip
    config: AutograderConfig
    assignment_name: str | None

    @property
    def files(self):
        return self.root / "files"

    @property
    def points(self):
        return {q: tf.possible for q, tf in self.tests.items()}

    def hidden_files(self):
        """Files the kernel sees only after the student's cells have run."""
        return [self.files / f"{self.checks_module}.py"] if self.checks_module else []

    def support_files(self):
        """Files copied into the kernel's working directory before the student's cells."""
        hidden = set(self.hidden_files())
        return [p for p in sorted(self.files.rglob("*")) if p.is_file() and p not in hidden] \
            if self.files.is_dir() else []

    def fingerprint(self):
        """Hashes of every file a trusted process imports, to detect rewrites during a batch."""
        paths = [*self.hidden_files(), *self.files.glob(f"{FORM_MODULE}.py"),
                 *sorted((self.root / "tests").glob("*.py"))]
        return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}


def open_autograder(zip_path, dest):
    """Extract ``zip_path`` into ``dest`` and read what grading needs from it."""
    with zipfile.ZipFile(zip_path) as zf:
        zf.extractall(dest)
    return read_autograder(dest)


def read_autograder(dest):
    """Read an autograder zip already extracted into ``dest``."""
    dest = pathlib.Path(dest)
    tests = {}
    for path in sorted((dest / "tests").glob("*.py")):
        tf = create_test_file(str(path), NBMetadataConfig())
        tests[tf.name] = tf
    config_path = dest / "otter_config.json"
    raw = json.loads(config_path.read_text()) if config_path.exists() else {}
    return Autograder(root=dest, tests=tests, checks_module=_find_checks_module(dest / "files"),
                      config=AutograderConfig(raw), assignment_name=raw.get("assignment_name"))


def _find_checks_module(files):
    for path in sorted(files.glob(CHECKS_FILE_GLOB)) if files.is_dir() else []:
        if path.stem != FORM_MODULE and _declares(path, CHECKS_MARKER):
            return path.stem
    return None


def _declares(path, name):
    """Whether the module at ``path`` assigns ``name`` at its top level (read, not imported)."""
    try:
        tree = ast.parse(path.read_text(errors="replace"))
    except SyntaxError:
        return False
    return any(isinstance(node, ast.Assign) and
               any(isinstance(t, ast.Name) and t.id == name for t in node.targets)
               for node in tree.body)


def shipped_autograder(assignment=None, notebooks=()):
    """The autograder zip this repository ships for ``assignment`` (or the one the notebooks name)."""
    # the checkout this package is installed from (editable): src/jaxlab/ -> the repository
    roots = [pathlib.Path.cwd(), pathlib.Path(jaxlab.__file__).resolve().parents[2]]
    zips = sorted({z.resolve() for r in roots for z in (r / "autograder").glob("*-autograder.zip")})
    if not zips:
        raise FileNotFoundError("no autograder/*-autograder.zip found; pass --autograder")
    names = {z.name.removesuffix("-autograder.zip"): z for z in zips}
    if assignment is None:
        named = {_assignment_name(p) or pathlib.Path(p).stem for p in notebooks}
        guessed = [n for n in names if n in named]
        if len(guessed) == 1 or len(names) == 1:
            return (names[guessed[0]] if guessed else zips[0])
        raise ValueError(f"several autograders ship ({', '.join(names)}); pass --assignment")
    matches = [z for n, z in names.items() if n == assignment or n.startswith(f"{assignment}-")]
    if len(matches) != 1:
        raise ValueError(f"no single shipped autograder for {assignment!r} (have {', '.join(names)})")
    return matches[0]


def _assignment_name(path):
    """The assignment a notebook was released for (otter writes it into the metadata)."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)["metadata"]["otter"]["assignment_name"]
    except Exception:
        return None
