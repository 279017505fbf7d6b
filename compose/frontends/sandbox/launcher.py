"""The inside of the code sandbox: run as ``python -I -B launcher.py`` by :mod:`compose.frontends.sandbox`.

Standard library only (it runs as a script, before and after the filesystem is taken away). The launcher
reads its configuration and the program (framed, on stdin), enters the namespaces, forks the program's
process and, while that one runs, judges it:

- the *program process* (untrusted): a private root (see :func:`_build_root`), a uid of its own or no
  capabilities, rlimits, a seccomp filter that refuses ``socket()`` and io_uring, then the program runs as
  ``__main__``; with a judge it then serves calls of its entry point: argument values in, result values out,
  one JSON line each over two pipes (:func:`encode` / :func:`decode`);
- the *launcher* (trusted): unreachable from the program (another pid namespace, not dumpable, none of its
  file descriptors left open in the program), it runs the problem's prompt, test and ``check`` with a proxy
  ``candidate`` that calls across, rebuilds every reply as plain built-in values, and writes the verdict as
  one JSON line on its stdout, which only the evaluator holds.
"""

from __future__ import annotations

import json
import os
import sys

SANDBOX_EXIT = 86  # the sandbox itself could not be built
CPU_EXIT = 124  # the program ran out of CPU time
MAX_MESSAGE = 64 * 2**20  # the largest reply (bytes of one JSON line) the judge accepts

# Linux constants (unshare(2), mount(2), prctl(2), seccomp(2)).
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE = 1024, 2048, 4096, 16384, 1 << 18
MS_RELATIME, MS_STRICTATIME, MNT_DETACH = 1 << 21, 1 << 24, 2
PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_SECCOMP, PR_CAPBSET_DROP = 1, 4, 22, 24
PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 36, 38
# machine -> (AUDIT_ARCH, pivot_root, socket, io_uring_setup, io_uring_enter, io_uring_register)
_SYSCALLS = {"x86_64": (0xC000003E, 155, 41, 425, 426, 427), "aarch64": (0xC00000B7, 41, 198, 425, 426, 427)}

_SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache",
                 "/etc/localtime")
_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
_ROOT = "/tmp"  # where the new root is assembled (over the host's /tmp, in the private mount namespace)


# ----------------------------------------------------------------------------------------------------
# Values across the boundary: tagged JSON, rebuilt as plain built-in values only
# ----------------------------------------------------------------------------------------------------


class Opaque:
    """A value the program returned that has no literal form (a generator, an object of its own): equal
    only to itself, so no assertion comparing it to an expected value can pass."""

    def __init__(self, type_name: str) -> None:
        self.type_name = type_name

    def __repr__(self) -> str:
        return f"<{self.type_name} object from the program>"


def encode(value, depth: int = 0):
    """A JSON-able tree for `value`: scalars as they are, containers as [tag, payload]; other objects as
    ["O", type name]."""
    if depth > 200:
        raise ValueError("value nested too deep")
    if value is None or isinstance(value, bool):
        return None if value is None else bool(value)
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        value = int(value)
        return value if -(2**53) < value < 2**53 else ["I", hex(value)]
    if isinstance(value, float):
        return float(value)
    if isinstance(value, complex):
        return ["C", value.real, value.imag]
    if isinstance(value, (bytes, bytearray)):
        return ["B", bytes(value).hex()]
    d = depth + 1
    for tag, kind in (("L", list), ("T", tuple), ("S", set), ("F", frozenset)):
        if isinstance(value, kind):
            return [tag, [encode(v, d) for v in value]]
    if isinstance(value, dict):
        return ["D", [[encode(k, d), encode(v, d)] for k, v in value.items()]]
    return ["O", type(value).__name__]


def decode(tree):
    """The value `tree` (from :func:`encode`) stands for, built from built-in types only; ValueError if
    `tree` is not of that form."""
    t = type(tree)
    if tree is None or t in (bool, int, float, str):
        return tree
    if t is not list or len(tree) not in (2, 3) or type(tree[0]) is not str:
        raise ValueError(f"not a value: {str(tree)[:80]}")
    tag, payload = tree[0], tree[1]
    if tag == "C" and len(tree) == 3 and all(type(x) in (int, float) for x in tree[1:]):
        return complex(tree[1], tree[2])
    if len(tree) != 2:
        raise ValueError(f"not a value: {str(tree)[:80]}")
    if tag in ("I", "B", "O") and type(payload) is str:
        if tag == "I":
            return int(payload, 16)
        return bytes.fromhex(payload) if tag == "B" else Opaque(payload[:100])
    if type(payload) is not list:
        raise ValueError(f"not a value: {str(tree)[:80]}")
    if tag == "D":
        if not all(type(kv) is list and len(kv) == 2 for kv in payload):
            raise ValueError("not a dict's items")
        return {decode(k): decode(v) for k, v in payload}
    kinds = {"L": list, "T": tuple, "S": set, "F": frozenset}
    if tag not in kinds:
        raise ValueError(f"unknown tag {tag[:10]!r}")
    return kinds[tag](decode(v) for v in payload)


def write_message(fd: int, message) -> None:
    data = (json.dumps(message, ensure_ascii=True, allow_nan=True) + "\n").encode()
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class LineReader:
    """Lines of a pipe, each at most MAX_MESSAGE bytes, within a deadline (for the judge's side)."""

    def __init__(self, fd: int, tick=None, tick_s: float = 0.01) -> None:
        self.fd, self.buffer, self.tick, self.tick_s = fd, bytearray(), tick, tick_s

    def read(self, deadline: float | None = None) -> bytes | None:
        """One line without its newline; None at end of file; TimeoutError past `deadline`; `tick()` runs
        every `tick_s` while it waits."""
        import select
        import time

        while (end := self.buffer.find(b"\n")) < 0:
            if len(self.buffer) > MAX_MESSAGE:
                raise ValueError(f"a message over {MAX_MESSAGE >> 20} MiB")
            while deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                if select.select([self.fd], [], [], min(left, self.tick_s) if self.tick else left)[0]:
                    break
                if self.tick:
                    self.tick()
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                return None
            self.buffer += chunk
        line = bytes(self.buffer[:end])
        del self.buffer[:end + 1]
        return line


# ----------------------------------------------------------------------------------------------------
# The launcher (trusted)
# ----------------------------------------------------------------------------------------------------


class _Stop(BaseException):
    """The run is over (the program died, timed out or broke the protocol): `check` cannot catch it."""

    def __init__(self, status: str, detail: str | None) -> None:
        super().__init__(detail)
        self.status, self.detail = status, detail


class _Run:
    """The launcher's view of one program process: its pipes, its deadline, its fate."""

    def __init__(self, cfg: dict, pid: int, requests: int, replies: int) -> None:
        import time

        self.cfg, self.pid, self.requests = cfg, pid, requests
        self.replies = LineReader(replies, tick=None if cfg.get("cgroup_path") else self.watch_memory)
        self.memory_limit = int(cfg["limits"]["memory_mb"]) * 2**20
        self.deadline = time.monotonic() + float(cfg["timeout_s"])
        self.memory_exceeded = False
        self.status: int | None = None

    def reap(self, kill: bool) -> int:
        import signal

        if self.status is None:
            if kill:
                _kill_tree(self.pid, signal.SIGKILL)
                if self.cfg["mode"] == "basic":  # orphans of the program came to the launcher (sub-reaper)
                    _kill_tree(os.getpid(), signal.SIGKILL, skip=os.getpid())
            _, self.status, usage = os.wait4(self.pid, 0)
            self.cpu_used = usage.ru_utime + usage.ru_stime
        return self.status

    def watch_memory(self) -> None:
        """Without a cgroup: sum the resident memory of the sample's processes and kill them all when it
        passes `memory_mb` (each process is also capped by RLIMIT_AS)."""
        import signal

        total, page = 0, os.sysconf("SC_PAGE_SIZE")
        for p in _descendants(self.pid):
            try:
                with open(f"/proc/{p}/statm") as f:
                    total += int(f.read().split()[1]) * page
            except (OSError, ValueError, IndexError):
                continue
        if total > self.memory_limit:
            self.memory_exceeded = True
            _kill_tree(self.pid, signal.SIGKILL)

    def gone(self) -> _Stop:
        """Why the program stopped answering."""
        if self.memory_exceeded or _cgroup_oom(self.cfg):
            return _Stop("failed", f"MemoryError: the sample's processes went over {self.cfg['limits']['memory_mb']}"
                                   " MiB together")
        status = self.reap(kill=True)
        code = _exit_code(status, self.cpu_used, self.cfg["limits"]["cpu_s"])
        if code == CPU_EXIT:
            return _Stop("timeout", None)
        if code == SANDBOX_EXIT:
            return _Stop("error", None)
        return _Stop("failed", None)  # the program's own last stderr line says why

    def receive(self):
        try:
            line = self.replies.read(self.deadline)
        except TimeoutError:
            raise _Stop("timeout", None) from None
        except ValueError as e:
            raise _Stop("failed", f"the program's reply is refused: {e}") from None
        if line is None:
            raise self.gone()
        try:
            return json.loads(line)
        except (ValueError, RecursionError) as e:
            raise _Stop("failed", f"the program's reply is not JSON: {str(e)[:100]}") from None

    def call(self, args: tuple, kwargs: dict):
        if self.replies.tick:
            self.replies.tick()
        try:
            write_message(self.requests, {"args": encode(list(args)), "kwargs": encode(kwargs)})
        except OSError:
            raise self.gone() from None
        reply = self.receive()
        if type(reply) is dict and type(reply.get("raise")) is list and len(reply["raise"]) == 2:
            raise _rebuilt_exception(*(str(x)[:1000] for x in reply["raise"]))
        if type(reply) is not dict or "value" not in reply:
            raise _Stop("failed", "the program's reply is not a value")
        try:
            return decode(reply["value"])
        except (ValueError, TypeError, RecursionError, MemoryError) as e:
            raise _Stop("failed", f"the program's reply is not a value: {str(e)[:100]}") from None


def _rebuilt_exception(type_name: str, message: str) -> BaseException:
    """The program's exception as a built-in one of the same name (else a plain Exception subclass)."""
    import builtins

    cls = getattr(builtins, type_name, None)
    if isinstance(cls, type) and issubclass(cls, BaseException) and not issubclass(cls, Exception):
        return _Stop("failed", f"{type_name}: {message}" if message else type_name)
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        name = type_name if type_name.isidentifier() else "ProgramError"
        cls = type(name, (Exception,), {"__module__": "builtins"})
    try:
        return cls(message) if message else cls()
    except Exception:  # noqa: BLE001 - e.g. UnicodeDecodeError needs five arguments
        return type(type_name, (Exception,), {"__module__": "builtins"})(message)


def _judge(run: _Run, judge: dict | None) -> tuple[str, str | None]:
    """(status, detail): the problem's test on the program, run here with a proxy candidate."""
    import traceback

    ready = run.receive()
    if judge is None:
        return ("passed", None) if ready == {"done": True} else ("failed", "the program sent a malformed message")
    if ready != {"ready": True}:
        return "failed", "the program sent a malformed message"
    entry = judge["entry_point"]

    def candidate(*args, **kwargs):
        return run.call(args, kwargs)

    candidate.__name__ = candidate.__qualname__ = entry
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(compile(judge["prompt"], "<prompt>", "exec"), namespace)
    except Exception as e:  # noqa: BLE001 - the problem's own fault
        return "error", f"the problem's prompt does not run: {type(e).__name__}: {e}"
    namespace[entry] = candidate
    try:
        exec(compile(judge["test"] + f"\ncheck({entry})\n", "<test>", "exec"), namespace)
    except _Stop as stop:
        return stop.status, stop.detail
    except Exception as e:  # noqa: BLE001 - an assertion (or any error) of the test fails the program
        return "failed", traceback.format_exception_only(type(e), e)[-1].strip()[:1000]
    return "passed", None


def launch() -> None:
    """The launcher's main: read the configuration, fork the program's process, judge, report."""
    cfg = json.loads(_read_frame(0))
    cfg["exposed"] = exposed_paths()
    if cfg["mode"] == "basic":
        _prctl(PR_SET_CHILD_SUBREAPER, 1)
    else:
        try:
            _enter_namespaces(cfg)
        except OSError as e:
            _sandbox_fail(f"cannot create namespaces: {e}")
    cgroup = _make_cgroup(cfg)
    req_r, req_w = os.pipe()
    rep_r, rep_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        _child(cfg, req_r, rep_w)
    _prctl(PR_SET_DUMPABLE, 0)  # no process of the same uid may read the launcher's memory
    os.close(req_r)
    os.close(rep_w)
    program = cfg.pop("program")
    del program  # the launcher itself never needs the program's text
    judge = json.loads(_read_frame(0))  # read after the fork: the program's process never holds the test
    run = _Run(cfg, pid, req_w, rep_r)
    try:
        status, detail = _judge(run, judge)
    except _Stop as stop:
        status, detail = stop.status, stop.detail
    except Exception as e:  # noqa: BLE001 - the launcher's own failure is the sandbox's
        status, detail = "error", f"sandbox: {type(e).__name__}: {e}"
    run.reap(kill=True)
    if status == "failed" and detail is None and (run.memory_exceeded or _cgroup_oom(cfg)):
        status, detail = "failed", run.gone().detail
    _remove_cgroup(cgroup)
    write_message(1, {"status": status, "detail": detail})
    os._exit(0)


def _read_frame(fd: int) -> bytes:
    """One frame: a 20-byte decimal length line, then that many bytes (read exactly, nothing more)."""
    def exactly(n: int) -> bytes:
        chunks, left = [], n
        while left:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                _sandbox_fail("the configuration was cut short")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    return exactly(int(exactly(20)))


def _exit_code(status: int, cpu_used: float, cpu_s: float) -> int:
    import signal

    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu_used >= cpu_s - 0.05):
            return CPU_EXIT
        return 128 + sig
    return os.WEXITSTATUS(status)


def _descendants(pid: int) -> list[int]:
    """`pid` and every process below it (via /proc/PID/task/TID/children); orphans of the sandbox are
    re-parented to pid (pid 1 of its namespace, or the launcher as sub-reaper, in basic mode)."""
    seen, todo = [], [pid]
    while todo:
        p = todo.pop()
        seen.append(p)
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
            except (OSError, ValueError):
                continue
    return seen


def _kill_tree(pid: int, sig: int, skip: int | None = None) -> None:
    for p in reversed(_descendants(pid)):
        if p == skip:
            continue
        try:
            os.kill(p, sig)
        except OSError:
            pass


def _make_cgroup(cfg: dict) -> str | None:
    """A cgroup v2 of this sample's own under the delegated `cfg["cgroup"]`: memory (no swap) and pids."""
    parent = cfg.get("cgroup")
    if not parent:
        return None
    path = os.path.join(parent, f"code-eval-{os.getpid()}")
    try:
        os.mkdir(path)
        lim = cfg["limits"]
        for name, value in (("memory.max", int(lim["memory_mb"]) * 2**20), ("memory.swap.max", 0),
                            ("pids.max", int(lim["max_processes"]))):
            if os.path.exists(os.path.join(path, name)):
                with open(os.path.join(path, name), "w") as f:
                    f.write(str(value))
    except OSError as e:
        _sandbox_fail(f"cannot make the sample's cgroup under {parent}: {e}")
    cfg["cgroup_path"] = path
    return path


def _cgroup_oom(cfg: dict) -> bool:
    path = cfg.get("cgroup_path")
    try:
        with open(os.path.join(path, "memory.events")) as f:
            return any(line.split()[0] in ("oom_kill", "oom_group_kill") and int(line.split()[1]) > 0
                       for line in f)
    except (OSError, TypeError, ValueError, IndexError):
        return False


def _remove_cgroup(path: str | None) -> None:
    import time

    if path is None:
        return
    try:
        with open(os.path.join(path, "cgroup.kill"), "w") as f:
            f.write("1")
    except OSError:
        pass
    for _ in range(200):
        try:
            os.rmdir(path)
            return
        except OSError:
            time.sleep(0.005)


def _sandbox_fail(message: str) -> None:
    try:
        os.write(2, f"sandbox: {message}\n".encode())
    finally:
        os._exit(SANDBOX_EXIT)


# ----------------------------------------------------------------------------------------------------
# The program's process (untrusted from the moment the program runs)
# ----------------------------------------------------------------------------------------------------


def _child(cfg: dict, requests: int, replies: int) -> None:
    """Build the sandbox around this process, drop privileges, run the program (and serve); never returns."""
    try:
        os.setsid()  # a group of its own: kill(0, ...) reaches no process outside the sandbox
        if cfg.get("cgroup_path"):
            with open(os.path.join(cfg["cgroup_path"], "cgroup.procs"), "w") as f:
                f.write("0")
        _isolate_fds(requests, replies)
        if cfg["mode"] != "basic":
            _build_root(cfg)
        os.chdir(cfg["work"])
        _drop_privileges(cfg)
        _set_limits(cfg)
        _deny_sockets()
    except Exception as e:  # noqa: BLE001 - any failure here is the sandbox's, not the program's
        _sandbox_fail(f"{type(e).__name__}: {e}")
    if cfg["python_guard"]:
        _python_guard()
    _run(cfg.pop("program"), cfg.get("entry_point"))


def _isolate_fds(requests: int, replies: int) -> None:
    """stdin and stdout on /dev/null, stderr kept, the two pipes on fds 3 and 4, every other fd closed."""
    import fcntl

    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    keep = [fcntl.fcntl(requests, fcntl.F_DUPFD, 100), fcntl.fcntl(replies, fcntl.F_DUPFD, 100)]
    os.dup2(keep[0], 3)
    os.dup2(keep[1], 4)
    os.closerange(5, 1 << 20)


def _run(source: str, entry_point: str | None) -> None:
    """Run the program as __main__; then report `done`, or serve calls of `entry_point`; exit at once."""
    import linecache
    import traceback
    import types

    pid = os.getpid()
    code = 1
    try:
        module = types.ModuleType("__main__")
        module.__file__ = "program.py"
        sys.modules["__main__"] = module
        sys.argv = ["program.py"]
        if len(source) < 2**20:
            linecache.cache["program.py"] = (len(source), None, source.splitlines(True), "program.py")
        exec(compile(source, "program.py", "exec"), module.__dict__)
        if os.getpid() == pid:
            if entry_point is None:
                write_message(4, {"done": True})
            else:
                _serve(module.__dict__, entry_point)
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


def _serve(namespace: dict, entry_point: str) -> None:
    """Call the entry point for each request (argument values in), reply with its value or exception."""
    if entry_point not in namespace:
        raise NameError(f"name {entry_point!r} is not defined")
    function = namespace[entry_point]
    write_message(4, {"ready": True})
    requests = LineReader(3)
    while (line := requests.read()) is not None:
        request = json.loads(line)
        try:
            value = function(*decode(request["args"]), **decode(request["kwargs"]))
            reply = {"value": encode(value)}
        except BaseException as e:  # noqa: BLE001 - the judge decides what the exception means
            reply = {"raise": [type(e).__name__, _message(e)]}
        write_message(4, reply)


def _message(e: BaseException) -> str:
    try:
        return str(e)[:1000]
    except BaseException:  # noqa: BLE001
        return ""


_LIBC = None


def _libc():
    global _LIBC
    import ctypes

    if _LIBC is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
        libc.prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
        libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
        libc.syscall.restype = ctypes.c_long
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


def _prctl(option: int, arg: int, arg2: int = 0) -> None:
    if sys.platform.startswith("linux"):
        _call("prctl", _libc().prctl(option, arg, arg2, 0, 0), str(option))


def _enter_namespaces(cfg: dict) -> None:
    """unshare pid, network, IPC and UTS namespaces (and a user namespace unless root); the program's
    process makes its own mount namespace."""
    flags = CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
    if cfg["mode"] == "userns":
        flags |= CLONE_NEWUSER
    _call("unshare", _libc().unshare(flags), hex(flags))
    if cfg["mode"] == "userns":
        for name, text in (("setgroups", "deny"), ("uid_map", f"0 {cfg['host_uid']} 1"),
                           ("gid_map", f"0 {cfg['host_gid']} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)


def exposed_paths() -> list[str]:
    """What the program's root holds besides /tmp, /proc and /dev: the system's libraries and the
    interpreter's own folders (outermost first, nested ones dropped)."""
    import sysconfig

    paths = {p for p in _SYSTEM_PATHS if os.path.lexists(p)}
    inner = {os.path.dirname(os.path.realpath(sys.executable))}
    inner |= {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    inner |= {p for p in sys.path if p}
    paths |= {os.path.realpath(p) for p in inner if os.path.isdir(p)}
    out: list[str] = []
    for p in sorted(paths):
        if not any(p == q or p.startswith(q.rstrip("/") + "/") for q in out):
            out.append(p)
    return out


def _build_root(cfg: dict) -> None:
    """A private mount namespace whose root holds only what the program needs, read-only: the system's
    libraries and the interpreter's folders, /dev/null and friends, a /proc of the sample's pid namespace
    and a size-capped tmpfs /tmp (its working folder, the only writable place). The host's root is
    detached: no host file, folder or socket outside those paths can be named."""
    _call("unshare", _libc().unshare(CLONE_NEWNS), "CLONE_NEWNS")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    sources = [(p, os.open(p, os.O_PATH | os.O_NOFOLLOW)) for p in [*cfg["exposed"], *_DEVICES]
               if os.path.exists(p) and not os.path.islink(p)]
    links = [(p, os.readlink(p)) for p in cfg["exposed"] if os.path.islink(p)]
    before = {mount_id for mount_id, _, _ in _mounts()}
    try:
        _mount("tmpfs", _ROOT, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=0755")
        # The sample's /tmp first: an exposed folder under /tmp (an interpreter in /tmp/...) is then bound inside
        # it instead of being hidden by it.
        _mount_sample_tmp(cfg)
        for path, fd in sources:
            target = _ROOT + path
            os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
            if os.path.isdir(f"/proc/self/fd/{fd}"):
                os.makedirs(target, mode=0o755, exist_ok=True)
            else:
                open(target, "w").close()
            _mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | MS_REC)
    finally:
        for _, fd in sources:
            os.close(fd)
    for path, dest in links:
        os.makedirs(os.path.dirname(_ROOT + path), mode=0o755, exist_ok=True)
        os.symlink(dest, _ROOT + path)
    os.makedirs(f"{_ROOT}/proc", mode=0o755, exist_ok=True)
    _mount("proc", f"{_ROOT}/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY)
    _make_read_only(under=_ROOT, keep={f"{_ROOT}/tmp", f"{_ROOT}/proc"}, skip_ids=before)
    os.chdir(_ROOT)
    machine = os.uname().machine
    if machine not in _SYSCALLS:
        raise OSError(f"no pivot_root number known for {machine}")
    _call("pivot_root", _libc().syscall(_SYSCALLS[machine][1], b".", b"."), ".")
    _call("umount2", _libc().umount2(b".", MNT_DETACH), ".")
    os.chdir("/")


def _mount_sample_tmp(cfg: dict) -> None:
    """The sample's size-capped tmpfs /tmp (its working folder, the only writable place) in the new root."""
    os.makedirs(f"{_ROOT}/tmp", mode=0o755, exist_ok=True)
    owner = f",uid={cfg['uid']},gid={cfg['gid']}" if cfg["uid"] is not None else ""
    size = max(1, int(cfg["limits"]["file_size_mb"]))
    _mount("tmpfs", f"{_ROOT}/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={size}m,nr_inodes=4096,mode=0700{owner}")


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount id, mount point, per-mount options) of this mount namespace, in mount order."""
    import re

    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
            out.append((fields[0], point, set(fields[5].split(","))))
    return out


def _make_read_only(under: str, keep: set[str], skip_ids: set[str]) -> None:
    """Re-mount every mount at or below `under` but `keep` (and those in `skip_ids`: the host's, hidden
    below) read-only and nosuid, keeping its other (possibly locked) flags."""
    for mount_id, point, opts in _mounts():
        if mount_id in skip_ids or point in keep or not (point == under or point.startswith(under + "/")):
            continue
        flags = MS_REMOUNT | MS_RDONLY | MS_NOSUID | (0 if point == under else MS_BIND)
        flags |= (MS_NODEV if "nodev" in opts or point == under else 0) | (MS_NOEXEC if "noexec" in opts else 0)
        flags |= MS_NODIRATIME if "nodiratime" in opts else 0
        flags |= MS_NOATIME if "noatime" in opts else MS_RELATIME if "relatime" in opts else MS_STRICTATIME
        _mount(None, point, None, flags)


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
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    _prctl(PR_SET_DUMPABLE, 0)
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # after setuid, which clears it
    if os.getppid() == 1 and cfg["mode"] == "basic":
        raise OSError("the launcher died")


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


def _deny_sockets() -> None:
    """A seccomp filter: socket() and io_uring fail with EACCES, foreign system-call ABIs are refused;
    socketpair() and everything else are allowed. No socket of any family (a Unix socket file, an abstract
    socket, the network) can be opened, whatever the filesystem holds."""
    import ctypes

    machine = os.uname().machine
    if not sys.platform.startswith("linux") or machine not in _SYSCALLS:
        return
    arch, _, *denied = _SYSCALLS[machine]
    ld_w_abs, jeq_k, ret_k = 0x20, 0x15, 0x06
    allow, errno = 0x7FFF0000, 0x00050000 | 13  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO | EACCES
    kill = 0x80000000  # SECCOMP_RET_KILL_PROCESS
    prog = [(ld_w_abs, 0, 0, 4), (jeq_k, 1, 0, arch), (ret_k, 0, 0, kill), (ld_w_abs, 0, 0, 0)]
    if machine == "x86_64":  # the x32 ABI (numbers with bit 30 set) would bypass the checks below
        prog += [(0x35, 0, 1, 0x40000000), (ret_k, 0, 0, errno)]  # jge k
    for i, nr in enumerate(denied):
        prog.append((jeq_k, len(denied) - i, 0, nr))
    prog += [(ret_k, 0, 0, allow), (ret_k, 0, 0, errno)]

    class Filter(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte),
                    ("k", ctypes.c_uint32)]

    class Program(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Filter))]

    filters = (Filter * len(prog))(*[Filter(*f) for f in prog])
    program = Program(len(prog), filters)
    _prctl(PR_SET_NO_NEW_PRIVS, 1)
    _call("prctl", _libc().prctl(PR_SET_SECCOMP, 2, ctypes.addressof(program), 0, 0), "PR_SET_SECCOMP")


def _python_guard() -> None:
    """Disable process creation, signals, sockets and destructive file operations at the Python level."""
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


if __name__ == "__main__":
    launch()
