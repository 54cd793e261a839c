"""A real one-node Slurm cluster on this machine, for the tests: munged, slurmctld and slurmd
(Debian's munge and slurm-wlm, installed by `make test`), with every file of theirs (key,
sockets, state, spool, logs, slurm.conf) in one folder and their own ports.
"""

import os
import pathlib
import shutil
import socket
import subprocess
import time

SBIN = pathlib.Path("/usr/sbin")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """``start()`` it, submit with ``env`` (SLURM_CONF), ``stop()`` it."""

    def __init__(self, root):
        self.root = pathlib.Path(root)
        self.node = socket.gethostname().split(".")[0]
        self.cpus = len(os.sched_getaffinity(0))
        self.conf = self.root / "slurm.conf"
        self.socket = self.root / "munge" / "munge.socket"
        self.procs = []

    @property
    def env(self):
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *cmd, check=True):
        return subprocess.run(cmd, env=self.env, capture_output=True, text=True, check=check)

    def start(self):
        missing = [p for p in ("munged", "slurmctld", "slurmd") if not (SBIN / p).exists()]
        assert not missing, f"{', '.join(missing)} missing: `make test` installs munge and " \
                            "slurm-wlm (make slurm)"
        for d in ("munge", "state", "spool", "log"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o600)
        m = self.root / "munge"
        subprocess.run([str(SBIN / "munged"), "--force", f"--key-file={key}",
                        f"--socket={self.socket}", f"--pid-file={m / 'munged.pid'}",
                        f"--log-file={m / 'munged.log'}", f"--seed-file={m / 'munged.seed'}"],
                       check=True, capture_output=True)
        self.conf.write_text(self.slurm_conf())
        (self.root / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n"
                                               "CgroupMountpoint=/sys/fs/cgroup\n")
        for daemon in ("slurmctld", "slurmd"):
            args = [str(SBIN / daemon), "-D", "-f", str(self.conf)]
            args += ["-N", self.node] if daemon == "slurmd" else []
            log = open(self.root / "log" / f"{daemon}.out", "w")
            self.procs.append(subprocess.Popen(args, env=self.env, stdout=log,
                                               stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            state = self.run("sinfo", "-h", "-o", "%t", check=False).stdout.strip()
            if state == "idle":
                return self
            time.sleep(0.5)
        raise RuntimeError(f"the test cluster did not come up (node state {state!r}):\n"
                           + self.logs())

    def slurm_conf(self):
        # proctrack/cgroup (the freezer) holds every process of a job, however it forked, so
        # scancel ends them all; task/affinity binds each task to its own CPUs
        freezer = pathlib.Path("/sys/fs/cgroup/freezer").is_dir()
        return "\n".join([
            "ClusterName=jaxlabtest",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            f"SlurmctldPort={_free_port()}", f"SlurmdPort={_free_port()}",
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={self.socket}",
            "SlurmUser=root", "SlurmdUser=root",
            f"StateSaveLocation={self.root / 'state'}", f"SlurmdSpoolDir={self.root / 'spool'}",
            f"SlurmctldPidFile={self.root / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.root / 'slurmd.pid'}",
            f"SlurmctldLogFile={self.root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={self.root / 'log' / 'slurmd.log'}",
            f"ProctrackType=proctrack/{'cgroup' if freezer else 'linuxproc'}",
            "TaskPlugin=task/affinity",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/backfill", "MpiDefault=none", "ReturnToService=2",
            "JobCompType=jobcomp/none", "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none", "KillWait=10",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN",
            f"PartitionName=test Nodes={self.node} Default=YES MaxTime=INFINITE State=UP", ""])

    def job(self, job_id):
        """``scontrol show job`` as a dict (the first record: an array's first task)."""
        out = self.run("scontrol", "show", "job", "-o", str(job_id), check=False).stdout
        fields = {}
        for word in out.split("\n")[0].split():
            k, _, v = word.partition("=")
            fields[k] = v
        return fields

    def queued(self, job_id):
        """Job ids (array tasks included) of ``job_id`` still pending or running."""
        out = self.run("squeue", "-h", "-j", str(job_id), "-o", "%i", check=False).stdout
        return out.split()

    def wait(self, job_id, timeout=600):
        deadline = time.monotonic() + timeout
        while self.queued(job_id):
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still queued after {timeout} s:\n"
                                   + self.run("squeue", check=False).stdout + self.logs())
            time.sleep(0.5)
        return self.job(job_id)

    def logs(self):
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}"
                         for p in sorted((self.root / "log").glob("*")))

    def stop(self):
        self.run("scancel", "--user=root", check=False)
        deadline = time.monotonic() + 60
        while self.run("squeue", "-h", check=False).stdout.strip() and \
                time.monotonic() < deadline:
            time.sleep(0.5)
        self.run("scontrol", "shutdown", check=False)
        for p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        subprocess.run([str(SBIN / "munged"), "--stop", f"--socket={self.socket}"],
                       capture_output=True)
        shutil.rmtree(self.root / "spool", ignore_errors=True)
