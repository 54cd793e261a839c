"""What grading passes around: batch settings, a submission's record, why a kernel stopped, and
where a kernel's evidence lies. Defaults live here and nowhere else.
"""

import dataclasses
import datetime
import enum
import json
import os
import pathlib

MiB = 2**20


@dataclasses.dataclass(frozen=True)
class Limits:
    """Per-submission limits (the CLI's --timeout, --cell-timeout, --memory, --processes,
    --cpus, --disk)."""

    timeout: float = 600  # wall-clock seconds for one submission
    cell_timeout: float = 300  # seconds for one cell; a cell over it is interrupted
    memory_mb: int = 4096  # resident memory of the kernel's whole process tree
    output_cap_mb: float = 10  # outputs beyond this are dropped
    # processes and threads of the whole sandbox together (cgroup pids.max); an honest Lab 3
    # kernel peaked at 57, Lab 4 at 56 (Record.peak_tasks, 8 simulated devices): ~9x margin
    processes: int = 512
    cpus: float = 1.0  # CPU time of the whole sandbox, in cores (cgroup CFS quota)
    disk_mb: int = 1024  # what the kernel may write into its folder, /tmp and home together


@dataclasses.dataclass(frozen=True)
class Settings:
    """What every worker of a batch gets, as one JSON line on its stdin."""

    autograder_root: str
    fingerprint: dict
    scratch: str
    limits: Limits = Limits()
    sandboxed: bool = False
    cache_dir: str | None = None  # the JAX compilation cache kernels (and the worker) read
    cache_writable: bool = False  # whether they may also write it: only trusted runs may
    reference_dir: str | None = None  # where the worker (never a kernel) keeps references
    prestart: bool = True
    cgroup: dict | None = None  # the batch's cgroup.Parent, kernels' cgroups go in (as_dict)
    disk_cap: bool = False  # whether each kernel's folder is a size-limited tmpfs
    kernel_uid: int | None = None  # unsandboxed kernels run as this user (a root container's)
    # gather every question's claim, then stop the kernel before judging, so that the judge's
    # JAX (~165 MiB) never adds to the student's kernel: in a 768 MB container Lab 4's kernel
    # (501 MiB) and the judging worker (283 MiB) did not fit together. Costs each question's
    # check run once more in the kernel, so batches (which have the memory) do not.
    claims_first: bool = False
    xla_threads: int | None = None
    cpu: int | None = None
    log: str | None = None

    def to_json(self):
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text):
        raw = json.loads(text)
        return cls(**{**raw, "limits": Limits(**raw["limits"])})


class StopKind(str, enum.Enum):
    TIMEOUT = "timeout"  # over the submission's wall-clock limit: killed
    MEMORY = "memory"  # over the memory cap: killed
    DIED = "died"  # the kernel exited or crashed by itself
    UNRESPONSIVE = "unresponsive"  # the kernel stopped answering its client
    PROCESSES = "processes"  # a process or thread start failed at the cap: killed


@dataclasses.dataclass(frozen=True)
class Stop:
    """Why and where a kernel stopped before the grader was done with it."""

    kind: StopKind
    cell: int | None = None  # notebook index of the student's cell running then, if one was
    in_grader: bool = False  # it stopped while the grader's cells read the answers
    detail: str = ""  # e.g. the memory figures

    @property
    def is_fault(self):
        """A death a second run without the cell can get past (a timeout already cost its time)."""
        return self.kind in (StopKind.MEMORY, StopKind.DIED, StopKind.PROCESSES) and \
            self.cell is not None

    def where(self):
        return f" in cell {self.cell}" if self.cell is not None else \
            " while the grader read the answers" if self.in_grader else ""

    def describe(self, timeout):
        """In words, for grading_status and for the messages of questions it left ungraded."""
        if self.kind is StopKind.TIMEOUT:
            return f"ran over {timeout:g} s{self.where()} and was killed"
        if self.kind in (StopKind.MEMORY, StopKind.PROCESSES):
            return f"killed{self.where()}: {self.detail}"
        if self.kind is StopKind.UNRESPONSIVE:
            return f"the kernel stopped answering{self.where()} ({self.detail})"
        return f"the kernel died{self.where()}"

    def to_dict(self):
        return {**dataclasses.asdict(self), "kind": self.kind.value}

    @classmethod
    def from_dict(cls, raw):
        return cls(**{**raw, "kind": StopKind(raw["kind"])})


@dataclasses.dataclass
class Record:
    """One graded submission: what the worker writes, the batch keeps and the report reads.

    ``questions`` maps each question to otter's test cases and their results
    ({"path", "all_or_nothing", "cases": [{"name", "hidden", "points", "success_message",
    "failure_message", "passed", "message"}]}); ``outcomes`` maps each question to "pass",
    "fail", "error" or "timeout".
    """

    file: str
    sha256: str
    status: str = ""
    catastrophic: bool = False  # nothing could be graded: zero points, the status says why
    questions: dict = dataclasses.field(default_factory=dict)
    outcomes: dict = dataclasses.field(default_factory=dict)
    flags: list = dataclasses.field(default_factory=list)  # tampering suspicions, in words
    # "question (exception)" for each trusted check that raised instead of judging: the
    # grader's fault, shown apart from tampering (older records load with none)
    grader_errors: list = dataclasses.field(default_factory=list)
    stop: Stop | None = None  # why the kernel stopped early (of the run that was graded)
    skipped: dict | None = None  # {"cell": i, "reason": Stop} when graded again without cell i
    sandboxed: bool = False
    peak_mb: float = 0
    peak_tasks: int = 0  # the most processes and threads its sandbox had at once (sampled)
    seconds: float = 0
    phases: dict = dataclasses.field(default_factory=dict)  # phase -> seconds, over its runs
    # the student's cells as their kernels timed them, over its runs (the benchmark compares)
    cell_seconds: float = 0
    # for the class's similarity check (``output.similarity``), kept so that ``jaxlab report``
    # compares without the submissions: question -> the code cells of its part of the notebook
    # (between the previous ``grader.check`` cell and its own), and question -> the traced
    # programs its probe recorded, as a bag of normalised dataflow steps ({step: count}).
    # Records written before these fields load with them empty.
    answers: dict = dataclasses.field(default_factory=dict)
    programs: dict = dataclasses.field(default_factory=dict)

    def to_dict(self):
        d = dataclasses.asdict(self)
        d["stop"] = self.stop.to_dict() if self.stop else None
        if self.skipped:
            d["skipped"] = {**self.skipped, "reason": self.skipped["reason"].to_dict()}
        return d

    @classmethod
    def from_dict(cls, raw):
        names = {f.name for f in dataclasses.fields(cls)}
        r = cls(**{k: v for k, v in raw.items() if k in names})
        r.stop = Stop.from_dict(r.stop) if r.stop else None
        if r.skipped:
            r.skipped = {**r.skipped, "reason": Stop.from_dict(r.skipped["reason"])}
        return r

    def write(self, path):
        path = pathlib.Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict()))
        tmp.replace(path)

    @classmethod
    def read(cls, path):
        return cls.from_dict(json.loads(pathlib.Path(path).read_text()))


@dataclasses.dataclass(frozen=True)
class EvidenceLayout:
    """The files a kernel's probes and claims write into the evidence folder."""

    folder: pathlib.Path

    def probe(self, question):
        return self.folder / f"{question}.json"  # with its arrays beside it in .npz

    def claim(self, question):
        return self.folder / f"claim-{question}.json"

    def strangers(self, questions):
        """Names in the folder that no probe or claim of ``questions`` writes."""
        expected = {p.with_suffix(x).name for q in questions
                    for p in (self.probe(q), self.claim(q)) for x in (".json", ".npz")}
        return sorted(p.name for p in self.folder.glob("*") if p.name not in expected)


@dataclasses.dataclass(frozen=True)
class Student:
    """One submitter of a submission, as Gradescope's export names them."""

    name: str
    sid: str = ""
    email: str = ""

    def key(self):
        """What tells two students apart: the email, else the SID, else the name."""
        return (self.email or self.sid or self.name).strip().lower()


@dataclasses.dataclass(frozen=True)
class Submitted:
    """Who handed in one submission and when (a group submission has several students)."""

    students: tuple  # of Student
    time: str = ""  # ISO 8601 with its UTC offset; "" when the export gives none
    entry: str = ""  # the entry of submission_metadata.yml, e.g. "submission_123456"


def write_atomically(path, data):
    """Write ``data`` (text or bytes) to ``path`` through a file of this process's own, so that
    shards writing the same file at once never see each other's half (the last one wins)."""
    path = pathlib.Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    if isinstance(data, bytes):
        tmp.write_bytes(data)
    else:
        tmp.write_text(data, encoding="utf-8")
    tmp.replace(path)


def instant(iso):
    """A submission time (``Submitted.time``) as a comparable instant; the earliest when ""."""
    return datetime.datetime.fromisoformat(iso) if iso else \
        datetime.datetime.min.replace(tzinfo=datetime.timezone.utc)


@dataclasses.dataclass
class Roster:
    """Who submitted what: ``file`` (the submission's key in the records) -> Submitted.
    Written once by the batch into the output folder, read by every later report."""

    source: str  # where it was read from, for messages
    files: dict = dataclasses.field(default_factory=dict)

    def to_dict(self):
        return {"source": self.source, "files": {
            f: {"students": [dataclasses.asdict(s) for s in sub.students], "time": sub.time,
                "entry": sub.entry} for f, sub in self.files.items()}}

    @classmethod
    def from_dict(cls, raw):
        return cls(raw["source"], {
            f: Submitted(tuple(Student(**s) for s in sub["students"]), sub.get("time", ""),
                         sub.get("entry", "")) for f, sub in raw["files"].items()})

    def write(self, path):
        write_atomically(path, json.dumps(self.to_dict(), indent=1))

    @classmethod
    def read(cls, path):
        return cls.from_dict(json.loads(pathlib.Path(path).read_text()))
