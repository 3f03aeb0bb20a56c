"""What must hold between runs and about a run's answer, over real HTTP on loopback.

The server has one worker, so consecutive requests run on the same worker (the same zygote, uid and
cgroup): whatever one run could leave there, the next one would find. Checked: nothing of a run persists
for the next (the kernel keyring, the network namespace), a program cannot forge its answer (status,
return code, time, files) by writing to descriptors it holds, the answer comes only once every process
of the run is dead, and only the program's process is a fork of the preloaded interpreter.
"""

from __future__ import annotations

import base64
import os
import re
import signal
import time
import uuid

import pytest

from sandbox.testing import ServerProcess, descendants, nested_pids, sandbox_uid_processes

SECRET = f"key-{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def server() -> ServerProcess:
    with ServerProcess("--workers", "1", "--max-sessions", "0", "--disk-mb", "64") as s:
        yield s


def run(server: ServerProcess, code: str, language: str = "python", **fields) -> dict:
    response = server.run_code(code, language, **fields)
    assert response.status_code == 200, response.text
    return response.json()


ADD_KEYS = f"""
import ctypes, platform
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
ADD_KEY = {{"x86_64": 248, "aarch64": 217}}[platform.machine()]
results = []
for ring in (-4, -3, -5):  # KEY_SPEC_USER_KEYRING, KEY_SPEC_SESSION_KEYRING, KEY_SPEC_USER_SESSION_KEYRING
    serial = libc.syscall(ctypes.c_long(ADD_KEY), b"user", b"agentrl-leak", {SECRET.encode()!r},
                          ctypes.c_size_t({len(SECRET)}), ctypes.c_long(ring))
    results.append(serial if serial > 0 else -ctypes.get_errno())
print(results)
"""


def test_no_key_of_a_run_is_there_for_the_next(server):
    """A run adds keys to its user, session and user-session keyrings; the next run on the worker sees
    none of them. (Keyrings live per uid and user namespace, outside any process: the programs' keyring
    calls are denied, ENOSYS as on a kernel without keys.)"""
    added = run(server, ADD_KEYS)
    assert added["run_result"]["stdout"] == "[-38, -38, -38]\n", added  # -ENOSYS each
    seen = run(server, "text = open('/proc/keys').read()\nprint('agentrl-leak' in text, repr(text))")
    assert seen["run_result"]["stdout"].startswith("False "), seen["run_result"]["stdout"]


def forge(report: dict) -> str:
    """Code that writes `report` to every descriptor it holds beyond stdio, then closes its output."""
    return f"""
import json, os
fake = json.dumps({report!r}).encode()
for fd in range(3, 64):
    try:
        os.write(fd, fake)
        os.close(fd)
    except OSError:
        pass
open('late.txt', 'w').write('after the forgery')
os.close(1)
os.close(2)
"""


def test_a_program_cannot_forge_success(server):
    forged = {"code": 0, "time": 12345.0, "files": {"forged.txt": "eA=="}}
    body = run(server, forge(forged) + "os._exit(5)", fetch_files=["late.txt", "forged.txt"])
    result = body["run_result"]
    assert (body["status"], result["status"], result["return_code"]) == ("Failed", "Finished", 5), body
    assert body["files"] == {"late.txt": base64.b64encode(b"after the forgery").decode()}
    assert result["execution_time"] <= 5  # the supervisor's own clock, bounded by its timeout


def test_a_program_cannot_forge_a_sandbox_error(server):
    body = run(server, forge({"error": "forged: the sandbox broke"}) + "os._exit(0)")
    assert (body["status"], body["message"], body["run_result"]["return_code"]) == ("Success", "", 0), body


def test_the_answer_comes_after_every_process_is_dead(server):
    """The program forges a report, closes its output and blocks, with a detached child blocked too: the
    answer is its time limit, and when it arrives no process of the run is left (checked at once)."""
    code = forge({"code": 0, "time": 0.5, "files": {}}) + """
r, w = os.pipe()
if os.fork() == 0:
    os.setsid()
    os.read(r, 1)  # never returns: the write end stays open
os.read(r, 1)
"""
    body = run(server, code, run_timeout=1)
    assert body["run_result"]["status"] == "TimeLimitExceeded" and body["message"] == "", body
    assert sandbox_uid_processes(server.uid_base) == []
    assert server.leftovers() == []


LOOPBACK = """
import socket
for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1"), (socket.AF_INET, "localhost")):
    listener = socket.socket(family)
    listener.bind((host, 0))
    listener.listen()
    client = socket.create_connection((host, listener.getsockname()[1]))
    peer, _ = listener.accept()
    client.sendall(b"ping")
    print(host, peer.recv(4).decode())
    client.close()  # closed first: this side stays in TIME_WAIT
    peer.close()
print(listener.getsockname()[1])
"""

REUSE = """
import socket
entries = [line.split() for line in open('/proc/net/tcp').read().splitlines()[1:]]
s = socket.socket()
s.bind(("127.0.0.1", {port}))  # no SO_REUSEADDR: refused if a TIME_WAIT of this port were here
print(len(entries), "bound")
"""


def test_each_run_has_its_own_loopback(server):
    """A program serves on 127.0.0.1, ::1 and localhost and connects to itself; the next run on the worker
    finds no socket of it (TIME_WAIT entries included) and can bind the same port."""
    lines = run(server, LOOPBACK)["run_result"]["stdout"].splitlines()
    assert lines[:3] == ["127.0.0.1 ping", "::1 ping", "localhost ping"], lines
    body = run(server, REUSE.format(port=int(lines[3])))
    assert body["run_result"]["stdout"] == "0 bound\n", body


def test_nothing_outside_the_run_is_reachable(server):
    code = f"""
import errno, socket
for address in [('127.0.0.1', {server.port}), ('10.0.0.1', 80), ('8.8.8.8', 53)]:
    try:
        socket.create_connection(address, timeout=2)
        print('connected')
    except OSError as e:
        print(errno.errorcode[e.errno])
"""
    # the service's own port is not in the run's network namespace; nothing routes out of it
    assert run(server, code)["run_result"]["stdout"] == "ECONNREFUSED\nENETUNREACH\nENETUNREACH\n"



def _prepared_program(server: ServerProcess) -> int:
    """The next run's program process (uid 1000 inside: the one worker's), waiting for its run."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for entry in filter(str.isdigit, os.listdir("/proc")):
            try:
                status = dict(line.split(":\t", 1) for line in open(f"/proc/{entry}/status").read().splitlines())
            except OSError:
                continue
            if int(status["Uid"].split()[0]) == server.uid_base + 1000 and status["State"].startswith("S"):
                return int(entry)
        time.sleep(0.05)  # a polling interval: the process table is read each time
    raise AssertionError("no prepared program process appeared")


def test_a_prepared_program_killed_while_waiting_is_replaced(server):
    """The next run's program process dies before its run arrives (here: killed from outside; in
    practice the OOM killer acting on the run before it, whose cgroup it shares): the run still gets a
    program process, in the run's memory cgroup."""
    assert server.leftovers() == []
    pid = _prepared_program(server)
    os.kill(pid, signal.SIGKILL)
    while not open(f"/proc/{pid}/status").read().split("State:\t")[1].startswith("Z"):
        time.sleep(0.01)  # a polling interval: dead (a zombie its supervisor has not reaped) before the run
    body = run(server, "print(open('/proc/self/cgroup').read())")
    assert body["status"] == "Success", body
    if server.cgroup_memory:
        assert re.search(r"/worker0\.\d+/run$", body["run_result"]["stdout"], re.M), body["run_result"]["stdout"]


def _nested(server: ServerProcess) -> dict[int, tuple[list[int], bool]]:
    """The server's processes: pid -> (its pid in each PID namespace, outermost first; whether it maps numpy)."""
    found = {}
    for pid in descendants(server.proc.pid):
        try:
            maps = open(f"/proc/{pid}/maps").read()
        except OSError:
            continue
        if (ids := nested_pids(pid)) is not None:
            found[pid] = (ids, "numpy" in maps)
    return found


def test_the_supervisor_is_lean_and_the_program_preloaded(server):
    """A run's supervisor is a fork of the zygote, which never imports the preload list: it maps no numpy.
    Its program's process (PID 2 beside it) is a fork of the forker's preloaded interpreter: numpy is mapped
    before any request. Checked on the next run's prepared pair."""
    pytest.importorskip("numpy")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        nested = _nested(server)
        runs = [maps for ids, maps in nested.values() if len(ids) == 3 and ids[-1] == 1]
        programs = [maps for ids, maps in nested.values() if len(ids) == 3 and ids[-1] == 2]
        if runs and programs:
            break
        time.sleep(0.05)  # a polling interval: the process table is read each time
    else:
        raise AssertionError(f"no prepared supervisor and program appeared: {nested}")
    assert not any(runs), nested
    assert all(programs), nested
    zygotes = [maps for ids, maps in nested.values() if len(ids) == 2 and ids[-1] == 1]
    assert zygotes == [False], nested


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def test_a_dead_forker_takes_its_worker_along(server):
    """Kill the worker's program forker: no run could get a program, so its zygote exits with it; the
    server reaps the old launcher and starts a new worker, runs succeed again, and nothing is left."""
    forkers = [pid for pid, (ids, _) in _nested(server).items() if len(ids) == 2 and ids[-1] == 2]
    assert len(forkers) == 1, _nested(server)
    launcher = _parent(_parent(forkers[0]))
    os.kill(forkers[0], signal.SIGKILL)
    deadline = time.monotonic() + 60
    while True:
        nested = _nested(server)
        fresh = [pid for pid, (ids, _) in nested.items() if len(ids) == 2 and ids[-1] == 2]
        if launcher not in descendants(server.proc.pid) and fresh:
            break
        assert time.monotonic() < deadline, f"the worker was not replaced: {nested}"
        time.sleep(0.1)  # polling the process table
    body = run(server, "print(1+1)")
    assert body["run_result"]["stdout"] == "2\n", body
    assert server.leftovers() == []


CHILDREN_OF_THE_FORKER = """
import ctypes, errno, os, platform, threading
libc = ctypes.CDLL(None, use_errno=True)
clone, clone3, ptrace = {'x86_64': (56, 435, 101), 'aarch64': (220, 435, 117)}[platform.machine()]
pid = libc.syscall(clone, 0x8000 | 17, 0, 0, 0, 0)  # CLONE_PARENT | SIGCHLD: a child of our parent
if pid == 0:
    os._exit(0)
print('clone', pid, errno.errorcode.get(ctypes.get_errno()))
print('clone3', libc.syscall(clone3, 0, 0), errno.errorcode.get(ctypes.get_errno()))
print('ptrace', libc.ptrace(0, 0, 0, 0), errno.errorcode.get(ctypes.get_errno()))  # PTRACE_TRACEME
t = threading.Thread(target=print, args=('thread',))
t.start()
t.join()
child = os.fork()
if child == 0:
    os._exit(3)
print('fork', os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]))
"""


def test_a_program_makes_no_child_of_the_forker_and_traces_nothing(server):
    """The program's parent is the worker's forker: clone(CLONE_PARENT) would leave it a zombie only the
    forker could reap, holding the run's supervisor in its exit and the worker with it; a tracer would hold
    a dead program's status from the forker. Both are refused (clone3 too: its flags are out of the filter's
    reach); threads and fork work; the next run is served."""
    body = run(server, CHILDREN_OF_THE_FORKER)
    assert body["run_result"]["stdout"] == ("clone -1 EPERM\nclone3 -1 ENOSYS\nptrace -1 ENOSYS\nthread\nfork 3\n"), body
    assert run(server, "print(1+1)")["run_result"]["stdout"] == "2\n"
    assert server.leftovers() == []


def test_a_program_signals_its_own_process_group_only(server):
    """Process groups span PID namespaces, and the next run's prepared program has the same uid: kill(0)
    must stop the program itself, not that one (whose run would then stall until its time limit)."""
    stopped = run(server, "import os, signal\nos.kill(0, signal.SIGSTOP)\nprint('not reached')", run_timeout=1)
    assert stopped["run_result"]["status"] == "TimeLimitExceeded", stopped
    body = run(server, "print(1+1)", run_timeout=5)
    assert body["status"] == "Success" and body["run_result"]["stdout"] == "2\n", body
    assert server.leftovers() == []
