"""The sandbox service over real HTTP on loopback: SandboxFusion-schema correctness and bad input.

One server (sandbox.testing.ServerProcess, a `python -m sandbox serve` subprocess) serves the module.
Hostile programs are in test_sandbox_hostile.py, sessions/overload/disconnect/the client in
test_sandbox_sessions.py, the Docker backend in test_sandbox_docker.py.
"""

from __future__ import annotations

import base64
import concurrent.futures
import json

import httpx
import pytest

from sandbox.testing import ServerProcess

TOKEN = "test-token-1234"
CODE_LIMIT = 100_000


@pytest.fixture(scope="module")
def server() -> ServerProcess:
    with ServerProcess("--workers", "3", "--max-sessions", "0", "--max-output-bytes", "65536",
                       "--max-code-bytes", str(CODE_LIMIT), "--disk-mb", "64", token=TOKEN) as s:
        yield s


def post(server: ServerProcess, body: dict | str, path: str = "/run_code", **kw) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    headers = {"content-type": "application/json", **server.headers, **kw.pop("headers", {})}
    return httpx.post(server.url + path, content=content, headers=headers, timeout=60, **kw)


def run(server: ServerProcess, code: str, **fields) -> dict:
    response = post(server, {"code": code, "language": fields.pop("language", "python"), **fields})
    assert response.status_code == 200, response.text
    return response.json()


def test_health(server):
    body = httpx.get(server.url + "/health").json()
    assert body["status"] == "ok" and body["backend"] == "namespace" and body["alive"] == 3


def test_stdout_and_success_schema(server):
    body = run(server, "print(1+1)")
    assert body["status"] == "Success" and body["message"] == "" and body["compile_result"] is None
    assert body["files"] == {}
    result = body["run_result"]
    assert result["status"] == "Finished" and result["return_code"] == 0
    assert result["stdout"] == "2\n" and result["stderr"] == ""
    assert isinstance(result["execution_time"], float)


def test_stderr_exit_codes_and_exceptions(server):
    body = run(server, "import sys\nprint('out')\nprint('err', file=sys.stderr)\nsys.exit(3)")
    assert body["status"] == "Failed"
    assert (body["run_result"]["stdout"], body["run_result"]["stderr"]) == ("out\n", "err\n")
    assert body["run_result"]["return_code"] == 3
    body = run(server, "def f():\n    return 1/0\nf()")
    assert body["status"] == "Failed" and body["run_result"]["return_code"] == 1
    stderr = body["run_result"]["stderr"]
    assert stderr.startswith('Traceback (most recent call last):\n  File "/tmp/work/main.py", line 3, in <module>\n'
                             "    f()\n")  # as `python main.py` shows it, source line included
    assert stderr.endswith("ZeroDivisionError: division by zero\n") and "sandbox" not in stderr
    body = run(server, "x = (")
    assert body["run_result"]["return_code"] == 1 and "SyntaxError" in body["run_result"]["stderr"]
    assert run(server, "raise SystemExit('bye')")["run_result"]["stderr"] == "bye\n"
    assert run(server, "import os; os._exit(7)")["run_result"]["return_code"] == 7


def test_stdin_args_and_main(server):
    body = run(server, "import sys\nprint(input()[::-1], sys.stdin.read().split(), sys.argv, __name__)",
               stdin="abc\n1 2\n3\n", args=["--n", "5"])
    assert body["run_result"]["stdout"] == "cba ['1', '2', '3'] ['/tmp/work/main.py', '--n', '5'] __main__\n"
    assert "EOFError" in run(server, "input()")["run_result"]["stderr"]


def test_files_in_and_out(server):
    files = {"data/in.txt": base64.b64encode(b"hello\n").decode(), "empty": None}
    code = ("import os\ntext = open('data/in.txt').read()\nopen('out.txt', 'w').write(text.upper())\n"
            "os.makedirs('sub', exist_ok=True)\nopen('sub/b.bin', 'wb').write(bytes(range(256)))\n"
            "print(os.getcwd(), sorted(os.listdir('.')))")
    body = run(server, code, files=files, fetch_files=["out.txt", "sub/b.bin", "missing.txt"])
    assert body["run_result"]["stdout"] == "/tmp/work ['data', 'main.py', 'out.txt', 'sub']\n"
    assert base64.b64decode(body["files"]["out.txt"]) == b"HELLO\n"
    assert base64.b64decode(body["files"]["sub/b.bin"]) == bytes(range(256))
    assert "missing.txt" not in body["files"]  # SandboxFusion leaves unfetchable files out


def test_each_run_starts_fresh(server):
    run(server, "open('left.txt', 'w').write('x'); open('/tmp/left2', 'w').write('x'); import math; math.pi = 3")
    body = run(server, "import os, math\nprint(os.listdir('.'), os.path.exists('/tmp/left2'), math.pi > 3.1)")
    assert body["run_result"]["stdout"] == "['main.py'] False True\n"
    draws = {run(server, "import random, numpy\nprint(random.random(), numpy.random.rand())")["run_result"]
             ["stdout"] for _ in range(3)}
    assert len(draws) == 3  # forked children must not replay the zygote's random state


def test_numpy_sympy_and_bash(server):
    body = run(server, "import numpy as np, sympy as sp\nx = sp.Symbol('x')\n"
                       "print(round(np.linalg.det(np.eye(3) * 2)), sp.integrate(x**2, (x, 0, 3)))")
    assert body["run_result"]["stdout"] == "8 9\n"
    body = run(server, "echo hi; echo oops > /dev/stderr; cat; exit 4", language="bash", stdin="piped\n")
    assert (body["run_result"]["stdout"], body["run_result"]["stderr"]) == ("hi\npiped\n", "oops\n")
    assert body["run_result"]["return_code"] == 4 and body["status"] == "Failed"
    body = run(server, "id -u; pwd; python -c 'import numpy; print(2)'", language="bash")
    uid, cwd, two = body["run_result"]["stdout"].split()
    assert 1000 <= int(uid) < 1003 and (cwd, two) == ("/tmp/work", "2")  # worker i runs as uid 1000 + i


def test_timeout(server):
    body = run(server, "import time\nprint('started', flush=True)\nwhile True: time.sleep(0.01)",
               run_timeout=1)
    assert body["status"] == "Failed" and body["run_result"]["status"] == "TimeLimitExceeded"
    assert body["run_result"]["return_code"] is None and body["run_result"]["stdout"] == "started\n"
    assert body["message"] == ""  # as SandboxFusion: the run_result's status says it
    assert run(server, "sleep 10", language="bash", run_timeout=0.5)["run_result"]["status"] == (
        "TimeLimitExceeded")


def test_output_truncation(server):
    body = run(server, "import sys\nsys.stdout.write('a' * 200000)\nsys.stderr.write('b' * 100)")
    stdout = body["run_result"]["stdout"]
    assert stdout.startswith("a" * 65536) and "output truncated: 200000 bytes written" in stdout
    assert body["run_result"]["stderr"] == "b" * 100 and body["status"] == "Success"


def test_memory_limit_is_per_request(server):
    code = "x = bytearray(300 * 1024 * 1024)\nprint('allocated')"
    small = run(server, code, memory_limit_MB=128)
    if server.cgroup_memory:  # real memory is counted: the kernel's OOM killer ends the program
        assert small["run_result"]["return_code"] == -9 and small["run_result"]["stdout"] == ""
    else:  # address space is limited: the allocation fails
        assert small["run_result"]["return_code"] == 1 and "MemoryError" in small["run_result"]["stderr"]
    assert run(server, code, memory_limit_MB=1024)["run_result"]["stdout"] == "allocated\n"


def test_concurrent_requests(server):
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(lambda i: run(server, f"print({i} * 2)")["run_result"]["stdout"], range(48)))
    assert outs == [f"{i * 2}\n" for i in range(48)]


def test_bad_input(server):
    missing = post(server, {"language": "python"})
    assert missing.status_code == 422 and "code" in missing.json()["message"]
    assert missing.json()["detail"][0]["loc"] == ["body", "code"]
    mistyped = post(server, {"code": "1", "language": "python", "run_timeout": "soon"})
    assert mistyped.status_code == 422 and "run_timeout" in mistyped.json()["message"]
    assert post(server, {"code": 5, "language": "python"}).status_code == 422
    malformed = post(server, '{"code": "print(1)", "language": ')
    assert malformed.status_code == 422 and "JSON" in malformed.json()["message"]
    escape = post(server, {"code": "1", "language": "python", "files": {"../x": ""}})
    assert escape.status_code == 422 and "files" in escape.json()["message"]
    outside = run(server, "1", fetch_files=["/etc/passwd", "../../etc/passwd"])  # left out, as missing files
    assert outside["status"] == "Success" and outside["files"] == {}
    unknown = post(server, {"code": "1", "language": "cpp"})
    assert unknown.status_code == 400 and "python, bash" in unknown.json()["detail"]
    big = post(server, {"code": "#" * (CODE_LIMIT + 1), "language": "python"})
    assert big.status_code == 413 and str(CODE_LIMIT) in big.json()["detail"]
    assert post(server, "x" * (70 << 20)).status_code == 413  # beyond max_request_bytes
    # what the kernel would refuse when the run starts is refused here, naming it
    for body, expected in [
        ({"code": "echo $1", "language": "bash", "args": ["a\x00b"]}, "NUL byte"),
        ({"code": "echo $1", "language": "bash", "args": ["x" * 140_000]}, "args[0] is 140000 bytes"),
        ({"code": "echo", "language": "bash", "args": ["x" * 100_000] * 11}, "at most 1048576"),
        ({"code": "1", "language": "python", "files": {"a": "", "a/b": ""}}, "collide"),
        ({"code": "1", "language": "python", "files": {"n" * 256: ""}}, "longer than 255 bytes"),
    ]:
        refused = post(server, body)
        assert refused.status_code == 422 and expected in refused.json()["message"], refused.text
    assert run(server, "echo ${#1}", language="bash", args=["x" * 100_000])["run_result"]["stdout"] == "100000\n"


def test_bearer_token(server):
    no_token = httpx.post(server.url + "/run_code", json={"code": "print(1)", "language": "python"})
    assert no_token.status_code == 401 and no_token.headers["www-authenticate"] == "Bearer"
    wrong = post(server, {"code": "1", "language": "python"}, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200  # health needs no token


def test_server_environment_is_not_inherited(server):
    body = run(server, "import os\nprint(sorted(os.environ))")
    names = eval(body["run_result"]["stdout"])
    assert "PATH" in names and not {n for n in names if n.startswith(("PYTEST", "AGENTRL", "VIRTUAL"))}
