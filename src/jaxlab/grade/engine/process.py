"""Processes of a batch: subreapers, killing a whole tree, reaping, giving memory back.

psutil finds and kills the processes; the two Linux calls it lacks (PR_SET_CHILD_SUBREAPER,
malloc_trim) go through ctypes.
"""

import ctypes

import psutil

PR_SET_CHILD_SUBREAPER = 36


def set_subreaper():
    """Orphaned descendants (e.g. a kernel's double-forked child) re-parent to this process."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except Exception:
        pass


def tree(pid):
    """The process ``pid`` and all its descendants (empty when it is gone)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def kill_and_reap(procs, wait=5):
    """SIGKILL every process in ``procs``; wait for ours so that no zombie is left."""
    procs = list(procs)
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=wait)


def descendants(since=None, spare=()):
    """This process's descendants (started at or after ``since``), except the whole trees
    rooted at the pids in ``spare``. Whole trees, read as the walk reaches them: a kernel that
    is still starting forks while we look (bwrap, then the kernel), and a child it forks after a
    snapshot of its tree was taken must not be killed as an orphan (under load that killed the
    next kernel before it replied: "Kernel died before replying to kernel_info")."""
    def wanted(p):
        try:
            return since is None or p.create_time() >= since - 1
        except psutil.Error:
            return False

    def children(p):
        try:
            return p.children()
        except psutil.Error:
            return []

    found, todo = [], children(psutil.Process())
    while todo:
        p = todo.pop()
        if p.pid in spare:
            continue
        if wanted(p):
            found.append(p)
        todo.extend(children(p))
    return found


def rss(procs):
    """Resident bytes of ``procs`` together (those that are gone count 0)."""
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def release_memory():
    """Give freed heap back to the OS, so a worker's resident size stays near its live data."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except Exception:
        pass


