"""Find submissions on disk and read each one's notebook, rejecting bad inputs with a reason."""

import dataclasses
import hashlib
import json
import pathlib
import zipfile

import nbformat

SUFFIXES = (".ipynb", ".zip")
MAX_ZIP_MEMBER = 256 * 2**20


class BadSubmission(Exception):
    """The file cannot be graded; the message says why, in words for the instructor."""


@dataclasses.dataclass(frozen=True)
class Submission:
    file: str  # the `file` column: the base name, or a relative path when base names clash
    path: pathlib.Path

    def digest(self):
        return hashlib.sha256(self.path.read_bytes()).hexdigest()


def collect(paths, exclude=()):
    """Every .ipynb and .zip named by ``paths`` or found under folders among them."""
    exclude = [pathlib.Path(e).resolve() for e in exclude]
    found = {}  # resolved path -> (path, name relative to the folder it was found in)
    for given in map(pathlib.Path, paths):
        if given.is_dir():
            candidates = [(p, p.relative_to(given).as_posix()) for p in sorted(given.rglob("*"))
                          if p.suffix.lower() in SUFFIXES and p.is_file()
                          and not any(part.startswith(".") for part in p.relative_to(given).parts)]
        else:
            candidates = [(given, given.name)]
        for path, rel in candidates:
            resolved = path.resolve()
            if not any(resolved.is_relative_to(e) for e in exclude):
                found.setdefault(resolved, (path, rel))
    counts = {}
    for path, _ in found.values():
        counts[path.name] = counts.get(path.name, 0) + 1
    subs = {}
    for path, rel in found.values():
        name = path.name if counts[path.name] == 1 else rel
        while name in subs:  # same relative path under two given folders
            name = f"{path.parent.name}/{name}"
        subs[name] = Submission(name, path)
    return sorted(subs.values(), key=lambda s: s.file)


def read_submission(path):
    """The notebook in ``path`` and the other files a zip carries (name -> bytes)."""
    path = pathlib.Path(path)
    data = path.read_bytes()
    if not data.strip():
        raise BadSubmission("empty file")
    if zipfile.is_zipfile(path):
        return _read_zip(path)
    if path.suffix.lower() != ".ipynb":
        raise BadSubmission(f"not a notebook or a zip: {path.name}")
    return _parse_notebook(data), {}


def _read_zip(path):
    try:
        with zipfile.ZipFile(path) as zf:
            members = [m for m in zf.infolist() if not m.is_dir() and _safe(m.filename)]
            notebooks = [m for m in members if m.filename.lower().endswith(".ipynb")
                         and ".ipynb_checkpoints" not in m.filename]
            if not notebooks:
                raise BadSubmission("the zip holds no notebook (.ipynb)")
            if len(notebooks) > 1:
                names = ", ".join(m.filename for m in notebooks)
                raise BadSubmission(f"the zip holds more than one notebook ({names})")
            if any(m.file_size > MAX_ZIP_MEMBER for m in members):
                raise BadSubmission("the zip holds a file over 256 MiB")
            extra = {m.filename: zf.read(m) for m in members if m is not notebooks[0]}
            return _parse_notebook(zf.read(notebooks[0])), extra
    except zipfile.BadZipFile as exc:
        raise BadSubmission(f"unreadable zip: {exc}") from None


def _safe(name):
    parts = pathlib.PurePosixPath(name).parts
    return bool(parts) and not name.startswith("/") and ".." not in parts \
        and not parts[0].startswith("__MACOSX")


def _parse_notebook(data):
    if not data.strip():
        raise BadSubmission("the notebook file is empty")
    try:
        raw = json.loads(data)
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadSubmission(f"not a notebook: the file is not valid JSON ({exc})") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("cells"), list):
        raise BadSubmission("not a notebook: the JSON has no list of cells")
    if not all(isinstance(c, dict) and "cell_type" in c for c in raw["cells"]):
        raise BadSubmission("not a notebook: a cell has no cell_type")
    try:
        return nbformat.reads(json.dumps(raw), as_version=4)
    except Exception as exc:
        raise BadSubmission(f"not a valid notebook: {str(exc).splitlines()[0][:200]}") from None
