"""Programs behave as under plain `python main.py` / `bash main.sh` (and SandboxFusion) where they can,
over real HTTP on loopback: signals, threads, real-memory limits, the program's own file, fetched files
after any kind of end, requests that cannot fit a run, and an interpreter that lives under /tmp.
"""

from __future__ import annotations

import base64
import os
import re
import site
import subprocess
import sys

import pytest

from sandbox.settings import MIN_MEMORY_MB
from sandbox.testing import ServerProcess

FETCH_BUDGET = 100_000


@pytest.fixture(scope="module")
def server() -> ServerProcess:
    with ServerProcess("--workers", "2", "--max-sessions", "0", "--disk-mb", "64",
                       "--max-fetch-bytes", str(FETCH_BUDGET)) as s:
        yield s


def run(server: ServerProcess, code: str, language: str = "python", **fields) -> dict:
    response = server.run_code(code, language, **fields)
    assert response.status_code == 200, response.text
    return response.json()


def result(body: dict) -> tuple[int | None, str]:
    return body["run_result"]["return_code"], body["run_result"]["stdout"]


def test_signals_end_the_program_as_they_would_plain_python(server):
    killed = run(server, "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\nprint('still here')")
    assert (result(killed), killed["status"]) == ((-9, ""), "Failed")
    assert result(run(server, "import os\nprint(os.getpid(), flush=True)\nos.abort()")) == (-6, "2\n")
    assert result(run(server, "import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\nprint('x')")) == (-15, "")
    interrupted = run(server, "raise KeyboardInterrupt")
    assert result(interrupted) == (-2, "") and "KeyboardInterrupt" in interrupted["run_result"]["stderr"]
    assert result(run(server, "echo $$; kill -TERM $$; echo after", language="bash")) == (143, "2\n")


def test_threads_and_memory_are_limited_by_real_use(server):
    threads = ("import threading\nfrom concurrent.futures import ThreadPoolExecutor\n"
               "barrier = threading.Barrier(32, timeout=30)\n"
               "def work(i):\n    barrier.wait()\n    return threading.get_ident(), len(bytearray(1 << 20))\n"
               "with ThreadPoolExecutor(32) as pool:\n    done = list(pool.map(work, range(32)))\n"
               "print(len({ident for ident, _ in done}), sum(size for _, size in done) >> 20)")
    assert result(run(server, threads, run_timeout=20)) == (0, "32 32\n")  # 32 threads alive at once
    # 2 GB of address space mapped but never touched is no memory use under a 128 MB budget
    mapped = "import mmap\nm = mmap.mmap(-1, 2 << 30)\nm[0] = 1\nprint('mapped')"
    if server.cgroup_memory:
        assert result(run(server, mapped, memory_limit_MB=128)) == (0, "mapped\n")


def test_the_program_runs_from_its_file(server):
    code = "# the first line\nimport sys\nprint(__file__, sys.argv, open(__file__).readline().strip())"
    body = run(server, code, args=["a"])
    assert result(body) == (0, "/tmp/work/main.py ['/tmp/work/main.py', 'a'] # the first line\n")
    given = base64.b64encode(b"print('given')").decode()
    body = run(server, "import os, runpy\nprint(__file__)\nrunpy.run_path('main.py')", files={"main.py": given})
    assert result(body) == (0, "/tmp/work/main_1.py\ngiven\n")
    assert result(run(server, "echo $0 $1", language="bash", args=["x"])) == (0, "/tmp/work/main.sh x\n")


def test_fetch_files_come_back_however_the_program_ended(server):
    ends = [
        ("python", "while True: pass", "TimeLimitExceeded", None),
        ("python", "import os\nos._exit(3)", "Finished", 3),
        ("python", "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", "Finished", -9),
        ("bash", "kill -KILL $$", "Finished", 137),
    ]
    for language, end, status, code in ends:
        write = "echo -n done > out.txt\n" if language == "bash" else "open('out.txt', 'w').write('done')\n"
        body = run(server, write + end, language, run_timeout=1, fetch_files=["out.txt"])
        assert (body["run_result"]["status"], body["run_result"]["return_code"]) == (status, code), body
        assert body["files"] == {"out.txt": base64.b64encode(b"done").decode()} and body["message"] == ""


def test_fetch_files_budget_and_paths(server):
    code = ("open('big.bin', 'wb').write(b'x' * 150_000)\nopen('small.txt', 'w').write('s')\n"
            "open('/tmp/abs.txt', 'w').write('a')\nopen('/tmp/up.txt', 'w').write('u')\nimport os\nos.mkfifo('pipe')")
    wanted = ["big.bin", "small.txt", "/tmp/abs.txt", "../up.txt", "/etc/hostname", "missing", "pipe", "."]
    body = run(server, code, fetch_files=wanted)
    assert body["status"] == "Success"
    assert {name: base64.b64decode(data) for name, data in body["files"].items()} == {
        "small.txt": b"s", "/tmp/abs.txt": b"a", "../up.txt": b"u"}  # the run's /tmp only, regular files only
    assert body["message"] == f"fetch_files over the {FETCH_BUDGET}-byte budget left out: big.bin (150000 bytes)"


def test_requests_that_do_not_fit_a_run_are_refused_naming_the_limit(server):
    many = server.run_code("print(1)", files={f"f{i}": "" for i in range(5000)})
    assert many.status_code == 413 and "inodes" in many.json()["detail"] and "--disk-mb 64" in many.json()["detail"]
    block = base64.b64encode(b"x" * (6 << 20)).decode()  # 18 MB: over the smallest budget, under /tmp
    big = server.run_code("print(1)", memory_limit_MB=MIN_MEMORY_MB, files={f"b{i}": block for i in range(3)})
    assert big.status_code == 413 and f"memory budget of {MIN_MEMORY_MB} MB" in big.json()["detail"], big.text
    deep = "/".join(["d"] * 1000) + "/f.txt"  # 2005 bytes: nested deep, well under PATH_MAX
    body = run(server, f"print(open({deep!r}).read())", files={deep: base64.b64encode(b"deep").decode()})
    assert result(body) == (0, "deep\n")


def test_client_mistakes_are_refused_not_sandbox_errors(server):
    """SandboxError means the service failed. A request whose stdin or decoded files fit the request-size
    limit but not the run's memory, or whose memory budget is too small for the interpreter, is the
    client's mistake: refused with 413 / 422 naming the sizes, the budget or the floor."""
    stdin = server.run_code("import sys\nprint(len(sys.stdin.read()))", memory_limit_MB=32, stdin="x" * (20 << 20))
    assert stdin.status_code == 413, stdin.text
    assert "memory budget of 32 MB" in stdin.json()["detail"] and str(20 << 20) in stdin.json()["detail"]
    block = base64.b64encode(b"x" * (10 << 20)).decode()  # fits /tmp (64 MB) and the budget's /tmp share
    files = server.run_code("print(1)", memory_limit_MB=40, files={"a.bin": block})
    assert files.status_code == 413 and "memory budget of 40 MB" in files.json()["detail"], files.text
    for memory in (1, 2, MIN_MEMORY_MB - 1):
        low = server.run_code("print(1)", memory_limit_MB=memory)
        assert low.status_code == 422 and f"floor is {MIN_MEMORY_MB} MB" in low.json()["message"], low.text
    assert server.run_code("print(1)", memory_limit_MB=True).status_code == 422  # not a 1 MB budget
    assert result(run(server, "print(1)", memory_limit_MB=MIN_MEMORY_MB)) == (0, "1\n")  # the floor starts
    # the least budget the check accepts (the need its refusal names) sets the run up: stdin and files arrive whole
    request = {"code": "import sys, os\nprint(len(sys.stdin.read()), os.path.getsize('a.bin'))",
               "stdin": "x" * (10 << 20), "files": {"a.bin": block}}
    refused = server.run_code(**request, memory_limit_MB=64)
    need = int(re.search(r"need (\d+) MB", refused.json()["detail"]).group(1))
    assert refused.status_code == 413 and str(10 << 20) in refused.json()["detail"] and need > 64, refused.text
    assert result(run(server, **request, memory_limit_MB=need)) == (0, f"{10 << 20} {10 << 20}\n")
    count = "import os\nn = 0\nwhile chunk := os.read(0, 1 << 16):\n    n += len(chunk)\nprint(n)"  # little memory
    for text in ("x" * (20 << 20), "é" * (5 << 20)):  # stdin alone, ASCII and not
        refused = server.run_code(count, memory_limit_MB=MIN_MEMORY_MB, stdin=text)
        need = int(re.search(r"need (\d+) MB", refused.json()["detail"]).group(1))
        body = run(server, count, memory_limit_MB=need, stdin=text)
        assert result(body) == (0, f"{len(text.encode())}\n"), body


def test_an_interpreter_under_tmp_serves(tmp_path):
    """A Python environment under /tmp (a repository cloned there, with its venv): each run's own tmpfs
    on /tmp gets the environment bound again on top of it."""
    assert str(tmp_path).startswith("/tmp/")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    packages = os.pathsep.join(site.getsitepackages())  # the server's dependencies; the zygote needs none
    with ServerProcess("--workers", "1", "--max-sessions", "0", "--preload", "math",
                       python=str(venv / "bin" / "python"), env={"PYTHONPATH": packages}) as server:
        body = run(server, "import sys, os\nprint(sys.prefix, os.path.exists(sys.executable))\nprint(1 + 1)")
        assert result(body) == (0, f"{venv} True\n2\n")
        assert run(server, "ls -d /tmp/work", language="bash")["run_result"]["stdout"] == "/tmp/work\n"
