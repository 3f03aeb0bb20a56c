"""Sessions, overload, client disconnects, a crashed worker and the `python` tool client
(agentrl/tools/code.py), against a real sandbox server on loopback. The server here has one worker and a
queue of one, so overload is easy to provoke, and a one-second idle timeout for sessions. The client's
retry logic is also checked against httpx.MockTransport doubles that answer like a SandboxFusion server.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import json
import os
import signal
import socket
import string
import time

import httpx
import pytest

from agentrl.tools.code import CodeTool
from agentrl.types import ToolCall
from sandbox.cgroups import mounts as cgroup_mounts
from sandbox.settings import MIN_MEMORY_MB
from sandbox.testing import ServerProcess, descendants, descriptors, free_port, sandbox_uid_processes


@pytest.fixture(scope="module")
def server() -> ServerProcess:
    with ServerProcess("--workers", "1", "--max-queue", "1", "--max-sessions", "3", "--session-idle", "1",
                       "--disk-mb", "64") as s:
        yield s


def call(server: ServerProcess, method: str, path: str, **kw) -> httpx.Response:
    return httpx.request(method, server.url + path, timeout=60, **kw)


def session_run(server: ServerProcess, sid: str, code: str, **fields) -> dict:
    response = call(server, "POST", f"/sessions/{sid}/run_code", json={"code": code, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def test_session_keeps_state_across_calls(server):
    created = call(server, "POST", "/sessions", json={})
    assert created.status_code == 201
    sid = created.json()["session_id"]
    first = session_run(server, sid, "import numpy as np\nx = np.arange(4)\nprint('set')")
    assert first["status"] == "Success" and first["run_result"]["stdout"] == "set\n"
    second = session_run(server, sid, "print(int(x.sum()))\nimport sys\nprint('e', file=sys.stderr)")
    assert (second["run_result"]["stdout"], second["run_result"]["stderr"]) == ("6\n", "e\n")
    broken = session_run(server, sid, "x = x * 2\nraise ValueError('boom')")
    assert broken["status"] == "Failed" and "ValueError: boom" in broken["run_result"]["stderr"]
    assert session_run(server, sid, "print(x.tolist())")["run_result"]["stdout"] == "[0, 2, 4, 6]\n"
    slow = session_run(server, sid, "import time\nwhile True: time.sleep(0.01)", run_timeout=0.5)
    assert slow["run_result"]["status"] == "TimeLimitExceeded" and "kept its state" in slow["message"]
    assert session_run(server, sid, "print(len(x))")["run_result"]["stdout"] == "4\n"
    assert call(server, "DELETE", f"/sessions/{sid}").status_code == 204
    assert call(server, "POST", f"/sessions/{sid}/run_code", json={"code": "1"}).status_code == 404
    assert server.leftovers() == []


def test_session_code_is_not_pid_1(server):
    """The session's code is a plain process under the session's supervisor: its own SIGTERM ends it."""
    sid = call(server, "POST", "/sessions", json={}).json()["session_id"]
    assert session_run(server, sid, "import os\nprint(os.getpid())")["run_result"]["stdout"] == "2\n"
    ended = session_run(server, sid, "import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\nprint('alive')")
    assert ended["run_result"]["return_code"] == 128 + 15 and ended["message"] == "the session ended; its state is gone"
    assert call(server, "POST", f"/sessions/{sid}/run_code", json={"code": "1"}).status_code == 404
    assert server.leftovers() == []


def test_session_that_ignores_the_interrupt_is_closed(server):
    sid = call(server, "POST", "/sessions", json={}).json()["session_id"]
    body = session_run(server, sid, "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
                                    "while True: pass", run_timeout=0.5)
    assert body["run_result"]["status"] == "TimeLimitExceeded" and "closed" in body["message"]
    assert call(server, "POST", f"/sessions/{sid}/run_code", json={"code": "1"}).status_code == 404
    assert server.leftovers() == []


def test_sessions_are_isolated_capped_and_expire(server):
    ids = [call(server, "POST", "/sessions", json={"idle_timeout": 30}).json()["session_id"] for _ in range(3)]
    over = call(server, "POST", "/sessions", json={})
    assert over.status_code == 429 and "Retry-After" in over.headers
    session_run(server, ids[0], "open('mine.txt', 'w').write('a')\nimport os\nuid = os.getuid()")
    probe = session_run(server, ids[1], "import os, glob\nprint(os.getuid(), os.listdir('.'), "
                                        "glob.glob('/proc/*/cwd/*'))")
    uid, listing = probe["run_result"]["stdout"].split(" ", 1)
    assert listing == "[] []\n"
    assert session_run(server, ids[0], "print(uid)")["run_result"]["stdout"].strip() != uid
    for sid in ids:
        assert call(server, "DELETE", f"/sessions/{sid}").status_code == 204
    call(server, "POST", "/sessions", json={"idle_timeout": 0.5})
    deadline = time.monotonic() + 20
    while call(server, "GET", "/sessions").json()["sessions"]:  # idle expiry
        assert time.monotonic() < deadline, "idle session was not closed"
        time.sleep(0.1)
    assert server.leftovers() == []


def test_a_session_is_reachable_only_through_its_creators_id(server):
    """Client A's session id is in nothing client B can read; B's guesses, near misses and A's id once
    closed all get the same 404 as a session that never existed; A keeps using its session."""
    created = call(server, "POST", "/sessions", json={})
    sid = created.json()["session_id"]
    assert len(sid) >= 22 and set(sid) <= set(string.ascii_letters + string.digits + "-_")  # 128 random bits
    session_run(server, sid, "secret = 42")
    listing = call(server, "GET", "/sessions")  # what B sees
    assert listing.status_code == 200 and sid not in listing.text and listing.json()["sessions"] == 1, listing.text
    assert sid not in call(server, "GET", "/health").text
    guesses = [sid[:-1] + ("A" if sid[-1] != "A" else "B"), sid[:-1], sid + "x", sid.upper() if sid.upper() != sid
               else sid.lower(), "0" * len(sid), os.urandom(16).hex(), "1"]
    for guess in guesses:
        for method, path, kw in [("POST", f"/sessions/{guess}/run_code", {"json": {"code": "print(secret)"}}),
                                 ("DELETE", f"/sessions/{guess}", {})]:
            answer = call(server, method, path, **kw)
            assert answer.status_code == 404 and "secret" not in answer.text, (guess, answer.text)
    assert session_run(server, sid, "print(secret)")["run_result"]["stdout"] == "42\n"  # A's session is intact
    assert call(server, "DELETE", f"/sessions/{sid}").status_code == 204
    gone = call(server, "POST", f"/sessions/{sid}/run_code", json={"code": "1"})
    assert gone.status_code == 404 and call(server, "DELETE", f"/sessions/{sid}").status_code == 404
    assert server.leftovers() == []


def test_session_calls_get_the_checks_of_run_code(server):
    """A session call the session cannot hold is the client's mistake, refused with 4xx as /run_code
    refuses it, never a SandboxError: too many files, files and stdin over the session's memory budget,
    files over what its /tmp has left after earlier calls, a budget under the floor."""
    for memory in (1, 2, True, 1.5):
        low = call(server, "POST", "/sessions", json={"memory_limit_MB": memory})
        assert low.status_code == 422 and "memory_limit_MB" in low.text, low.text
        assert memory is True or memory == 1.5 or f"floor is {MIN_MEMORY_MB} MB" in low.text, low.text
    sid = call(server, "POST", "/sessions", json={"memory_limit_MB": 48}).json()["session_id"]
    many = call(server, "POST", f"/sessions/{sid}/run_code", json={"code": "1", "files": {f"f{i}": "" for i in range(5000)}})
    assert many.status_code == 413 and "inodes" in many.json()["detail"], many.text
    stdin = call(server, "POST", f"/sessions/{sid}/run_code", json={"code": "1", "stdin": "x" * (20 << 20)})
    assert stdin.status_code == 413 and "memory budget of 48 MB" in stdin.json()["detail"], stdin.text
    assert session_run(server, sid, "print('still here')")["run_result"]["stdout"] == "still here\n"
    call(server, "DELETE", f"/sessions/{sid}")
    roomy = call(server, "POST", "/sessions", json={"memory_limit_MB": 1024}).json()["session_id"]
    block = {"code": "1", "files": {"a.bin": base64.b64encode(b"x" * (40 << 20)).decode()}}
    assert session_run(server, roomy, **block)["status"] == "Success"
    full = call(server, "POST", f"/sessions/{roomy}/run_code", json={**block, "files": {"b.bin": block["files"]["a.bin"]}})
    assert full.status_code == 413 and "No space left" in full.json()["detail"], full.text  # the 64 MB /tmp
    assert session_run(server, roomy, "import os\nprint(os.path.getsize('a.bin'))")["run_result"]["stdout"] == f"{40 << 20}\n"
    call(server, "DELETE", f"/sessions/{roomy}")
    assert server.leftovers() == []


def test_session_cap_holds_under_concurrent_creates_and_idle_is_bounded():
    with ServerProcess("--workers", "1", "--max-sessions", "2", "--max-session-idle", "50", "--disk-mb", "64") as s:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = [f.result() for f in [pool.submit(call, s, "POST", "/sessions", json={}) for _ in range(8)]]
        assert sorted(a.status_code for a in answers) == [201, 201] + [429] * 6
        for created in [a for a in answers if a.status_code == 201]:
            assert call(s, "DELETE", f"/sessions/{created.json()['session_id']}").status_code == 204
        created = call(s, "POST", "/sessions", json={"idle_timeout": 1e300})
        assert created.status_code == 201 and created.json()["idle_timeout"] == 50.0
        too_big = call(s, "POST", "/sessions", content='{"idle_timeout": 1e400}',  # JSON's way to say inf
                       headers={"content-type": "application/json"})
        assert too_big.status_code == 422 and "idle_timeout" in too_big.text
        call(s, "DELETE", f"/sessions/{created.json()['session_id']}")
        assert s.leftovers() == []


HOLD_IN_CHILDREN = """
import os
go_r, go_w = os.pipe()
kids = []
for _ in range(3):
    ready_r, ready_w = os.pipe()  # one each: EOF tells the parent that child died before it was ready
    pid = os.fork()
    if pid == 0:
        os.close(ready_r)
        os.close(go_w)
        block = b"x" * (150 << 20)  # written, so resident: 150 MB in each child, under any per-process limit
        os.write(ready_w, b"1")
        os.read(go_r, 1)
        os._exit(0)
    os.close(ready_w)
    kids.append((pid, ready_r))
for _, ready_r in kids:
    os.read(ready_r, 1)
os.close(go_w)
print([os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid, _ in kids])
"""


def _memory_group(server: ServerProcess, sid: str) -> str:
    """The memory cgroup a session's process is in, as the session reads it."""
    out = session_run(server, sid, "print(open('/proc/self/cgroup').read())")["run_result"]["stdout"]
    return next(line.split(":", 2)[2] for line in out.splitlines() if line.split(":")[1] == "memory")


def test_each_session_has_its_own_memory_budget_and_the_budgets_are_admitted():
    """Each session's processes together are held to its own budget, in a memory cgroup of its own: a
    session whose three children hold 450 MB against its 300 MB is OOM-killed there (each child alone
    is under the budget) while the other session's state lives on. A session whose budget would take the
    open sessions' sum past --sessions-memory-mb is refused with 429; a closed session's group is removed."""
    with ServerProcess("--workers", "1", "--max-sessions", "4", "--sessions-memory-mb", "700", "--disk-mb", "64") as s:
        if not s.cgroup_memory:
            pytest.skip("the server has no usable memory cgroups here (it falls back to RLIMIT_AS per process)")
        ids = [call(s, "POST", "/sessions", json={"memory_limit_MB": 300}).json()["session_id"] for _ in range(2)]
        over = call(s, "POST", "/sessions", json={"memory_limit_MB": 200})
        assert over.status_code == 429 and "hold 600 MB of the 700 MB" in over.json()["detail"], over.text
        never = call(s, "POST", "/sessions", json={"memory_limit_MB": 800})
        assert never.status_code == 422 and "together may use 700 MB" in never.json()["detail"], never.text
        groups = [_memory_group(s, sid) for sid in ids]
        assert groups[0] != groups[1] and all("/session." in g for g in groups), groups
        mount = next(m for m, fstype, opts in cgroup_mounts() if fstype == "cgroup2" or "memory" in opts)
        assert all(os.path.isdir(mount + g) for g in groups)
        holders = [(pid, fd) for pid in descendants(s.proc.pid) for fd, target in descriptors(pid)
                   if "/session." in target]
        assert holders == [], f"processes still hold a session group's procs file: {holders}"
        session_run(s, ids[1], "keep = b'k' * (100 << 20)")
        filled = call(s, "POST", f"/sessions/{ids[0]}/run_code", json={"code": HOLD_IN_CHILDREN}).json()
        killed = filled["message"] == "the session ended; its state is gone" or "-9" in filled["run_result"]["stdout"]
        assert killed and "[0, 0, 0]" not in filled["run_result"]["stdout"], filled
        assert call(s, "GET", "/health").json()["session_oom_kills"] >= 1
        assert session_run(s, ids[1], "print(len(keep))")["run_result"]["stdout"] == f"{100 << 20}\n"
        for sid in ids:
            call(s, "DELETE", f"/sessions/{sid}")
        whole = call(s, "POST", "/sessions", json={"memory_limit_MB": 700})
        assert whole.status_code == 201, whole.text
        assert not any(os.path.isdir(mount + g) for g in groups), groups
        call(s, "DELETE", f"/sessions/{whole.json()['session_id']}")
        assert s.leftovers() == []


def _health_until(server: ServerProcess, condition, what: str) -> None:
    deadline = time.monotonic() + 30
    while not condition(health := call(server, "GET", "/health").json()):
        assert time.monotonic() < deadline, f"{what}: /health stayed {health}"
        time.sleep(0.01)  # a polling interval: the state is read each time


def test_overload_answers_503(server):
    """One worker, a queue of one: with A running and B queued (seen in /health), C and D are refused."""
    busy = {"code": "while True: pass", "language": "python", "run_timeout": 3}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        a = pool.submit(call, server, "POST", "/run_code", json=busy)
        _health_until(server, lambda h: h["idle"] == 0, "A never started")
        b = pool.submit(call, server, "POST", "/run_code", json={"code": "print(2)", "language": "python"})
        _health_until(server, lambda h: h["queued"] == 1, "B never queued")
        refused = [call(server, "POST", "/run_code", json={"code": "print(3)", "language": "python"}) for _ in range(2)]
        assert [r.status_code for r in refused] == [503, 503]
        waiting = call(server, "GET", "/health").json()["queue_wait_s"]
        assert a.result().json()["run_result"]["status"] == "TimeLimitExceeded"
        assert b.result().json()["run_result"]["stdout"] == "2\n"
    assert refused[0].headers["retry-after"] == "1" and "overloaded" in refused[0].json()["detail"]
    waited = call(server, "GET", "/health").json()["queue_wait_s"]  # B waited for A's whole run
    assert waiting["longest_now"] > 0 and waited["longest_now"] == 0 and waited["limit"] == 60
    assert waited["max_since_start"] >= waiting["longest_now"] and waited["samples"] >= 2
    assert call(server, "POST", "/run_code", json={"code": "print(1)", "language": "python"}).status_code == 200


def test_client_disconnect_kills_the_run(server):
    def open_fds() -> int:
        """The server's Unix sockets (a run's report socket is one); its TCP connections come and go with
        the test's own requests, so they are not counted."""
        unix = {line.split()[6] for line in open(f"/proc/{server.proc.pid}/net/unix").readlines()[1:]}
        links = [target for _, target in descriptors(server.proc.pid)]
        return sum(link.startswith("socket:[") and link[8:-1] in unix for link in links)

    assert call(server, "POST", "/run_code", json={"code": "print(1)", "language": "python"}).status_code == 200
    before = open_fds()
    payload = json.dumps({"code": "import os, time\nos.fork()\ntime.sleep(60)", "language": "python",
                          "run_timeout": 60}).encode()
    for _ in range(3):
        with socket.create_connection(("127.0.0.1", server.port)) as client:  # hung up once the run is seen
            client.sendall(b"POST /run_code HTTP/1.1\r\nHost: sandbox\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
            deadline = time.monotonic() + 30
            while not sandbox_uid_processes(server.uid_base):  # the fork of the run's program
                assert time.monotonic() < deadline, "the run's forked process never appeared"
                time.sleep(0.01)  # a polling interval: the process table is read each time
        assert server.leftovers(timeout=30) == []  # both processes gone, long before run_timeout
    body = call(server, "POST", "/run_code", json={"code": "print(1+1)", "language": "python"}).json()
    assert body["run_result"]["stdout"] == "2\n"
    # nothing of the abandoned runs stays open in the server (a leaked report socket at EOF would also
    # keep its reader firing on every turn of the event loop)
    deadline = time.monotonic() + 30
    while open_fds() > before:
        assert time.monotonic() < deadline, f"server descriptors {open_fds()}, {before} before the disconnects"
        time.sleep(0.1)  # polling the server's own state: it closes connections asynchronously


def _run_cgroup(server: ServerProcess) -> str | None:
    """The cgroup a run's program is in, as the run reads it (None where runs have no cgroup of their own)."""
    if not server.cgroup_memory:
        return None
    body = call(server, "POST", "/run_code", json={"code": "print(open('/proc/self/cgroup').read())",
                                                     "language": "python"}).json()
    return next(line.split(":", 2)[2] for line in body["run_result"]["stdout"].splitlines() if line.endswith("/run"))


def test_a_dead_worker_is_replaced(server):
    """Kill every worker's launcher (the run worker's and the sessions' zygote's): each takes its zygote
    and prepared children along; both are replaced and the dead launchers reaped. The replacement has a
    cgroup of its own: removing the dead one's (which may happen again once the replacement runs) leaves
    the replacement's in place."""
    before = _run_cgroup(server)
    launchers = [pid for pid in descendants(server.proc.pid) if _is_root_child_of(pid, server.proc.pid)]
    assert len(launchers) == 2  # one run worker (--workers 1) and the sessions' zygote
    for pid in launchers:
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while True:
        health = call(server, "GET", "/health").json()
        current = descendants(server.proc.pid)
        fresh = [pid for pid in current if _is_root_child_of(pid, server.proc.pid)]
        if health["alive"] == health["workers"] and len(fresh) == 2 and not set(launchers) & current:
            break
        assert time.monotonic() < deadline, f"workers not replaced: {health}, launchers {fresh} (killed {launchers})"
        time.sleep(0.1)  # polling the service's own state
    body = call(server, "POST", "/run_code", json={"code": "print(1+1)", "language": "python"}).json()
    assert body["run_result"]["stdout"] == "2\n"
    after = _run_cgroup(server)
    assert before is None or (after != before and after.startswith(before.rsplit("/", 2)[0])), (before, after)
    sid = call(server, "POST", "/sessions", json={}).json()["session_id"]
    assert session_run(server, sid, "x = 6 * 7\nprint(x)")["run_result"]["stdout"] == "42\n"
    call(server, "DELETE", f"/sessions/{sid}")
    assert server.leftovers() == []


def _is_root_child_of(pid: int, parent: int) -> bool:
    """Whether `pid` is a root-owned child of `parent`; False for a process that exited meanwhile (the
    listing also holds short-lived runs)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        return ppid == parent and os.stat(f"/proc/{pid}").st_uid == 0
    except (FileNotFoundError, ProcessLookupError):
        return False


def tool_result(tool: CodeTool, code: str):
    async def go():
        try:
            return await tool.call(ToolCall("python", {"code": code}))
        finally:
            await tool.aclose()

    return asyncio.run(go())


def test_code_tool_against_the_server(server):
    ok = tool_result(CodeTool(server.url), "print(6 * 7)")
    assert ok.ok and ok.text == "42\n" and ok.metadata["return_code"] == 0
    failed = tool_result(CodeTool(server.url), "print('partial')\n1/0")
    assert failed.error == "execution_error" and failed.text.startswith("partial\nTraceback")
    assert failed.metadata["stderr"].endswith("ZeroDivisionError: division by zero\n")
    slow = tool_result(CodeTool(server.url, run_timeout=0.5), "while True: pass")
    assert slow.error == "timeout" and "Timeout" in slow.text
    refused = tool_result(CodeTool(server.url, language="cpp"), "int main() {}")
    assert refused.error == "http_400" and "not supported" in refused.text

    async def with_session():
        tool = CodeTool(server.url)
        async with tool.session() as session:
            await session.call(ToolCall("python", {"code": "y = 5"}))
            result = await session.call(ToolCall("python", {"code": "print(y + 1)"}))
        await tool.aclose()
        return result

    assert asyncio.run(with_session()).text == "6\n"


def test_code_tool_connection_error_is_bounded():
    port = free_port()  # nothing listens here
    result = tool_result(CodeTool(f"http://127.0.0.1:{port}", max_retries=2, backoff_s=0.01), "print(1)")
    assert result.error == "connection" and result.metadata["attempts"] == 3


def mock_tool(responses: list[httpx.Response]) -> tuple[CodeTool, list[dict]]:
    seen: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return responses[min(len(seen), len(responses)) - 1]

    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return CodeTool("http://sandbox", client=client, backoff_s=0.01, max_retries=3), seen


def test_code_tool_retries_5xx_and_maps_sandbox_fusion_answers():
    fusion_ok = {"status": "Success", "message": "", "compile_result": None, "executor_pod_name": "pod-1",
                 "run_result": {"status": "Finished", "execution_time": 0.02, "return_code": 0,
                                "stdout": "2\n", "stderr": ""}, "files": {}}
    tool, seen = mock_tool([httpx.Response(503, headers={"Retry-After": "0"}), httpx.Response(502),
                            httpx.Response(200, json=fusion_ok)])
    result = tool_result(tool, "print(1+1)")
    assert result.ok and result.text == "2\n" and result.metadata["attempts"] == 3
    assert seen[0] == seen[2] and seen[0]["language"] == "python" and seen[0]["code"] == "print(1+1)"
    tool, seen = mock_tool([httpx.Response(500)])
    assert tool_result(tool, "x").error == "http_500" and len(seen) == 4  # 1 + max_retries
    fusion_error = {"status": "SandboxError", "message": "runner crashed", "run_result": None, "files": {}}
    tool, seen = mock_tool([httpx.Response(200, json=fusion_error)])
    error = tool_result(tool, "x")
    assert error.error == "sandbox_error" and "runner crashed" in error.text and len(seen) == 1
    tool, _ = mock_tool([httpx.Response(422, json={"detail": [{"loc": ["body", "code"]}]})])
    assert tool_result(tool, "x").error == "http_422"
    assert asyncio.run(CodeTool("http://sandbox").call(ToolCall("python", {}))).error == "malformed"


def test_running_out_of_descriptors_leaks_nothing_and_frees_the_worker(monkeypatch):
    """open_channels fails half-way (out of descriptors): what it opened is closed, and execute() gives
    the worker back to the pool with an Error outcome, instead of losing it."""
    from sandbox import run as run_module
    from sandbox.settings import Settings

    real_pipe2, calls = os.pipe2, []

    def failing_second_pipe(flags):
        calls.append(flags)
        if len(calls) == 2:
            raise OSError(24, "Too many open files")
        return real_pipe2(flags)

    monkeypatch.setattr(run_module.os, "pipe2", failing_second_pipe)

    class Worker:  # never reached: spawn would need the descriptors
        uid, map_self, memory_cgroup = 1000, False, False

        def host_uid(self, uid):
            return None

    released = []

    async def attempt():
        before = len(os.listdir("/proc/self/fd"))
        job = run_module.Job("print(1)", "python", 1.0, 64)
        outcome = await run_module.execute(Worker(), job, Settings(), released.append)
        return outcome, before, len(os.listdir("/proc/self/fd"))

    outcome, before, after = asyncio.run(attempt())
    assert outcome.status == "Error" and "Too many open files" in outcome.message
    assert len(released) == 1 and after == before


def test_a_session_reply_its_code_forged_is_its_error_not_the_servers(server):
    """The session's socket is its code's too: a reply frame the code writes itself, with a field of the
    wrong type, answers as the session's malformed reply (200, an error), never as a 500."""
    sid = call(server, "POST", "/sessions", json={}).json()["session_id"]
    forged = ("import os\nfrom sandbox.wire import encode_frame\n"
              "os.write(3, encode_frame({'code': 0, 'timed_out': {'x': 1}, 'files': {}, 'time': 0.1}))")
    body = session_run(server, sid, forged)
    assert (body["status"], body["message"]) == ("SandboxError", "the session's reply was malformed"), body
    call(server, "DELETE", f"/sessions/{sid}")
