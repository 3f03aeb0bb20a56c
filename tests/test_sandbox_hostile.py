"""Hostile programs against the real sandbox over loopback HTTP.

Each must be contained (the assertion on its own result), leave no process behind (no process under a
run uid, the service's process tree back to its idle size: `ServerProcess.leftovers`) and leave the
service answering `print(1+1)`. Correctness and bad input are in test_sandbox.py.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import sys
import uuid
from pathlib import Path

import pytest

from sandbox.testing import ServerProcess, descendants, descriptors

SECRET = f"s3cret-{uuid.uuid4().hex}"
FIND_SECRET = f"{SECRET[::-1]!r}[::-1]"  # the secret in a program's code that does not hold it (its own file)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> ServerProcess:
    host_secret = tmp_path_factory.mktemp("host") / "secret.txt"
    host_secret.write_text(SECRET)
    env = {"AGENTRL_TEST_SECRET": SECRET, "AGENTRL_SECRET_FILE": str(host_secret)}
    with ServerProcess("--workers", "3", "--max-sessions", "0", "--max-output-bytes", "65536",
                       "--disk-mb", "64", "--max-processes", "32", env=env) as s:
        s.secret_file = str(host_secret)
        yield s


def run(server: ServerProcess, code: str, language: str = "python", **fields) -> dict:
    response = server.run_code(code, language, **fields)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture
def contained(server):
    """After the test: nothing left running, and the service still serves normal requests."""
    yield
    assert server.leftovers() == []
    assert run(server, "print(1+1)")["run_result"]["stdout"] == "2\n"


def out(body: dict) -> str:
    return body["run_result"]["stdout"]


def test_fork_bomb(server, contained):
    body = run(server, "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
               run_timeout=2)
    assert body["run_result"]["status"] == "TimeLimitExceeded"
    body = run(server, ":(){ :|:& };:", language="bash", run_timeout=2)
    assert body["run_result"]["status"] in ("TimeLimitExceeded", "Finished")


def test_memory_bomb(server, contained):
    body = run(server, "blocks = []\nwhile True:\n    blocks.append(bytearray(50 * 1024 * 1024))",
               memory_limit_MB=256)
    if server.cgroup_memory:  # the run's real memory is counted: the OOM killer ends it
        assert body["run_result"]["return_code"] == -9, body
    else:  # its address space is limited: allocation fails
        assert body["run_result"]["return_code"] == 1 and "MemoryError" in body["run_result"]["stderr"]
    # Several processes: the cgroup caps their sum (each alone is under the budget).
    # 8 x 200 MB touched under 256 MB: the cgroup's OOM killer must SIGKILL some of them (without the cgroup
    # cap all 8 exit 0). The parent, small, normally reports; if it is the one killed, its run says so.
    code = ("import os\nfor _ in range(8):\n    if os.fork() == 0:\n        b = bytearray(200 * 1024 * 1024)\n"
            "        for i in range(0, len(b), 4096): b[i] = 1\n        os._exit(0)\n"
            "killed = 0\nwhile True:\n    try: killed += os.wait()[1] & 0x7f == 9\n    except ChildProcessError: break\n"
            "print('killed', killed)")
    body = run(server, code, memory_limit_MB=256, run_timeout=20)
    result = body["run_result"]
    if result["stdout"].startswith("killed"):
        assert int(result["stdout"].split()[1]) >= 1, result
    else:
        assert result["return_code"] in (-9, 137), result


def test_infinite_loop(server, contained):
    body = run(server, "while True: pass", run_timeout=1)
    assert body["status"] == "Failed" and body["run_result"]["status"] == "TimeLimitExceeded"


def test_hundred_megabytes_of_output(server, contained):
    body = run(server, "import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(100):\n    sys.stdout.write(chunk)",
               run_timeout=30)
    stdout = out(body)
    assert len(stdout) < 70000 and "output truncated: 104857600 bytes written" in stdout
    body = run(server, "yes | head -c 100000000", language="bash", run_timeout=30)
    assert "output truncated: 100000000 bytes written" in out(body)


def test_writing_outside_the_working_dir(server, contained):
    targets = ["/etc/passwd", "/usr/evil", "/root/evil", "/evil", f"{REPO}/evil", "/proc/sys/kernel/hostname",
               "/dev/evil", os.path.dirname(server.secret_file) + "/evil"]
    code = (f"import json\nresults = {{}}\nfor path in {targets!r}:\n    try:\n        open(path, 'a').write('x')\n"
            "        results[path] = 'written'\n    except OSError as e:\n        results[path] = type(e).__name__\n"
            "print(json.dumps(results))")
    results = json.loads(out(run(server, code)))
    assert "written" not in results.values(), results
    for path in targets[1:]:
        assert not os.path.exists(path) or path.startswith("/proc"), path
    body = run(server, "echo x > /usr/evil; echo x > /etc/evil; touch /evil; echo done", language="bash")
    assert out(body) == "done\n" and body["run_result"]["stderr"].count("Read-only file system") == 3


def test_reading_secrets(server, contained):
    code = f"""
import glob, os
hits = []
for path in ['/etc/shadow', '/etc/gshadow', {REPO + '/pyproject.toml'!r}, {REPO + '/sandbox/server.py'!r},
             {server.secret_file!r}, '/root/.bash_history', '/etc/ssl/private']:
    print(path, os.path.exists(path))
for path in glob.glob('/proc/*/environ') + glob.glob('/proc/*/cmdline'):
    try:
        if {FIND_SECRET}.encode() in open(path, 'rb').read():
            hits.append(path)
    except OSError:
        pass
skip = {{'/proc', '/usr', '/sys', '/dev', {sys.prefix!r}, {sys.base_prefix!r}}}  # read-only installs
for root, dirs, files in os.walk('/', onerror=lambda e: None):
    dirs[:] = [d for d in dirs if os.path.join(root, d) not in skip]
    for name in files:
        try:
            if {FIND_SECRET}.encode() in open(os.path.join(root, name), 'rb').read(1 << 20):
                hits.append(os.path.join(root, name))
        except OSError:
            pass
repo = [n for n in ('pyproject.toml', 'sandbox', 'agentrl', 'tests') if os.path.exists(os.path.join({REPO!r}, n))]
print('hits', hits, {FIND_SECRET} in str(os.environ), sorted(e for e in os.listdir('/proc') if e.isdigit()), repo)
"""
    lines = out(run(server, code, run_timeout=30)).splitlines()
    assert all(line.endswith(" False") for line in lines[:-1]), lines
    # no secret, no process but the run's supervisor (1) and the program (2), no source tree
    assert lines[-1] == "hits [] False ['1', '2'] []", lines[-1]


def test_network_is_unreachable(server, contained):
    code = f"""
import socket
for address in [('127.0.0.1', {server.port}), ('8.8.8.8', 53), ('1.1.1.1', 443), ('::1', {server.port})]:
    try:
        socket.create_connection(address, timeout=2)
        print(address, 'connected')
    except OSError as e:
        print(address, 'refused', e.errno)
try:
    socket.getaddrinfo('example.com', 80)
    print('dns resolved')
except OSError as e:
    print('dns refused', e.errno)
"""
    lines = out(run(server, code, run_timeout=20)).splitlines()
    assert len(lines) == 5 and all(" refused " in line for line in lines), lines


def test_killing_everything(server, contained):
    body = run(server, "import os, signal\nos.kill(1, signal.SIGKILL)\nprint('still here')")
    assert body["run_result"]["status"] in ("Finished", "TimeLimitExceeded")
    body = run(server, "kill -9 -1; echo after $?", language="bash")
    assert body["run_result"]["status"] == "Finished"
    body = run(server, "import os, signal\nfor pid in range(1, 400):\n    try: os.kill(pid, signal.SIGKILL)\n"
                       "    except OSError: pass\nprint('done')")
    assert body["run_result"]["status"] == "Finished"


def test_no_privileges_inside(server, contained):
    code = ("import os\nstatus = dict(l.split(':\\t', 1) for l in open('/proc/self/status').read().splitlines())\n"
            "print(os.getuid() >= 1000, status['CapEff'].strip(), status['CapBnd'].strip(), status['NoNewPrivs'])\n"
            "for step in (lambda: os.setuid(0), lambda: os.chroot('/tmp'), lambda: os.mknod('/tmp/dev', 0o20600, os.makedev(1, 3))):\n"
            "    try:\n        step()\n        print('allowed')\n    except OSError as e:\n        print(e.errno)")
    full_set = (1 << (int(Path("/proc/sys/kernel/cap_last_cap").read_text()) + 1)) - 1  # this kernel's capabilities
    assert out(run(server, code)) == f"True 0000000000000000 {full_set:016x} 1\n1\n1\n1\n"
    body = run(server, "unshare -U true || echo no-userns; unshare -m true || echo no-mountns; "
                       "mount -t tmpfs none /tmp/work 2>/dev/null || echo no-mount", language="bash")
    assert out(body) == "no-userns\nno-mountns\nno-mount\n"


def test_filling_the_disk(server, contained):
    # Files each under RLIMIT_FSIZE, together over the tmpfs size: ENOSPC (28), not the host's disk.
    code = ("import os\nwritten = 0\ntry:\n    for n in range(100):\n        with open(f'fill{n}', 'wb') as f:\n"
            "            for _ in range(8):\n                f.write(b'x' * (1 << 20)); f.flush(); written += 1\n"
            "except OSError as e:\n    print(e.errno, written <= 64)")
    assert out(run(server, code, run_timeout=20)) == "28 True\n"
    body = run(server, "head -c 500000000 /dev/zero > /tmp/big; echo rc=$?; stat -c %s /tmp/big",
               language="bash", run_timeout=20)
    rc, size = out(body).split()
    assert rc != "rc=0" and int(size) <= 64 << 20  # stopped by RLIMIT_FSIZE (SIGXFSZ) or the tmpfs size


def test_daemon_does_not_outlive_its_run(server, contained):
    code = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            "        time.sleep(120)\n    os._exit(0)\nprint('parent done')")
    assert out(run(server, code)) == "parent done\n"
    assert out(run(server, "nohup sleep 120 >/dev/null 2>&1 & disown; echo bye", language="bash")) == "bye\n"


def test_runs_cannot_read_each_others_files(server, contained):
    # The two runs are isolated, so nothing can sequence them: each prints the window it was alive in, and
    # the test checks the reader's scans did overlap the writer's files.
    writer = (f"import time\nt0 = time.time()\nopen('mine.txt', 'w').write({SECRET!r})\n"
              f"open('/tmp/mine2', 'w').write({SECRET!r})\ntime.sleep(3)\nprint('wrote', t0, time.time())")
    reader = f"""
import glob, os, time
found = set()
start = time.time()
end = start + 3
while time.time() < end:
    for pattern in ['/tmp/**', '/proc/*/cwd/**', '/proc/*/root/tmp/**', '/dev/shm/**']:
        for path in glob.glob(pattern, recursive=True):
            try:
                if os.path.isfile(path) and {FIND_SECRET} in open(path, errors='ignore').read():
                    found.add(path)
            except OSError:
                pass
    time.sleep(0.05)
print('found', sorted(found), start, time.time())
"""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(run, server, writer, run_timeout=10)
        second = pool.submit(run, server, reader, run_timeout=10)
        wrote, w0, w1 = out(first.result()).split()
        found, r0, r1 = out(second.result()).rsplit(maxsplit=2)
    assert wrote == "wrote" and found == "found []"
    assert float(r0) < float(w1) and float(w0) < float(r1), "the reader ran outside the writer's lifetime"


def test_cgroup_v1_swap_limit_follows_the_memory_limit():
    """Where swap is accounted (cgroup v1 memsw), a run's memory+swap limit is its memory limit, also
    after a request lowers or raises it: no swapping around the budget. Likewise the worker's own cap."""
    from sandbox.cgroups import CgroupSet

    cgroups, why = CgroupSet.create()
    if cgroups is None or cgroups.version != "v1":
        pytest.skip(f"needs cgroup v1: {why}")
    worker = f"test-{uuid.uuid4().hex[:8]}"
    path = os.path.join(cgroups.groups["memory"], worker)
    try:
        cgroups.make(worker, 4 << 30, 16, 1 << 30)
        if not os.path.exists(os.path.join(path, "memory.memsw.limit_in_bytes")):
            pytest.skip("this kernel does not account swap (no memory.memsw.limit_in_bytes)")

        def limits(group: str) -> tuple[int, int]:
            return tuple(int(open(os.path.join(group, f)).read())
                         for f in ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes"))

        assert limits(path) == (4 << 30, 4 << 30)
        for mb in (512, 2048, 256):
            cgroups.set_run_memory(worker, mb << 20)
            assert limits(os.path.join(path, "run")) == (mb << 20, mb << 20)
    finally:
        cgroups.destroy()


def test_fetching_a_link_never_reads_outside_the_run(server, contained):
    # Each name links somewhere the run's /tmp does not hold; the supervisor must not follow it there.
    links = {"self_fd": "/proc/self/fd/2", "sup_fd0": "/proc/1/fd/0", "sup_fd1": "/proc/1/fd/1",
             "sup_fd2": "/proc/1/fd/2", "sup_fd3": "/proc/1/fd/3", "passwd": "/etc/passwd",
             "log": server.log.name, "secret": server.secret_file, "up": "../../etc/hostname",
             "dev": "/dev/zero"}
    code = ("import os\nopen('ok.txt', 'w').write('fine')\nos.symlink('ok.txt', 'inside')\n"
            f"for name, target in {links!r}.items():\n    os.symlink(target, name)\nprint('linked')")
    body = run(server, code, fetch_files=[*links, "ok.txt", "inside"])
    assert out(body) == "linked\n"
    assert set(body["files"]) == {"ok.txt", "inside"}, sorted(body["files"])
    assert body["files"]["ok.txt"] == body["files"]["inside"] == "ZmluZQ=="  # base64 of "fine"
    for name in links:  # each refusal is named in the answer's message
        assert name in body["message"], (name, body["message"])


def test_no_sandbox_process_holds_a_host_file(server, contained):
    """A /proc/<pid>/fd/N path reopens what that descriptor points at: no zygote, supervisor or prepared
    program may hold a host regular file (the server's log as inherited stderr) for a run to reach."""
    import stat

    held = []
    for pid in descendants(server.proc.pid):
        for fd, target in descriptors(pid):
            try:
                st = os.stat(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            # Not host files: namespaces (`pid:[...]`), memfds, the run cgroup's control file (how a
            # program joins its cgroup; a kernel interface, no data).
            if (stat.S_ISREG(st.st_mode) and target.startswith("/")
                    and not target.startswith(("/memfd:", "/sys/fs/cgroup/"))):
                held.append(f"pid {pid} fd {fd} -> {target}")
    assert held == []


def test_only_the_needed_socket_families(server, contained):
    code = """
import errno, socket
for name, family, kind, proto in [('vsock', 40, socket.SOCK_STREAM, 0), ('packet', 17, socket.SOCK_RAW, 0),
                                  ('alg', 38, socket.SOCK_SEQPACKET, 0), ('key', 15, socket.SOCK_RAW, 2),
                                  ('netlink_audit', 16, socket.SOCK_RAW, 9), ('uevent', 16, socket.SOCK_DGRAM, 15),
                                  ('bluetooth', 31, socket.SOCK_STREAM, 0), ('xdp', 44, socket.SOCK_RAW, 0)]:
    try:
        socket.socket(family, kind, proto).close()
        print(name, 'created')
    except OSError as e:
        print(name, errno.errorcode.get(e.errno))
try:
    socket.socketpair(40, socket.SOCK_STREAM)
    print('vsock pair created')
except OSError as e:
    print('vsock pair', errno.errorcode.get(e.errno))
a, b = socket.socketpair()
a.send(b'u'); print('unix', b.recv(1).decode())
server = socket.create_server(('127.0.0.1', 0))
client = socket.create_connection(server.getsockname()); conn, _ = server.accept()
client.send(b'4'); print('inet', conn.recv(1).decode())
server6 = socket.create_server(('::1', 0), family=socket.AF_INET6)
client6 = socket.create_connection(server6.getsockname()[:2]); conn6, _ = server6.accept()
client6.send(b'6'); print('inet6', conn6.recv(1).decode())
print('interfaces', [name for _, name in socket.if_nameindex()])
"""
    lines = out(run(server, code)).splitlines()
    refused = [line for line in lines if line.endswith(" EAFNOSUPPORT")]
    assert len(refused) == 9, lines
    assert lines[9:] == ["unix u", "inet 4", "inet6 6", "interfaces ['lo']"], lines


def test_no_inotify_on_shared_files(server, contained):
    code = """
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
for name in ('inotify_init1', 'fanotify_init'):
    fd = libc.inotify_init1(0) if name == 'inotify_init1' else libc.fanotify_init(0, 0)
    print(name, fd if fd >= 0 else errno.errorcode.get(ctypes.get_errno()))
params = ctypes.create_string_buffer(120)
fd = libc.syscall(425, 4, params)  # io_uring_setup: its IORING_OP_SOCKET would bypass the socket filter
print('io_uring_setup', fd if fd >= 0 else errno.errorcode.get(ctypes.get_errno()))
import asyncio, json, multiprocessing, subprocess, numpy, sympy
print(subprocess.run(['true']).returncode, sympy.Integer(2) ** 10)
"""
    assert out(run(server, code)) == ("inotify_init1 ENOSYS\nfanotify_init ENOSYS\n"
                                     "io_uring_setup ENOSYS\n0 1024\n")
    body = run(server, "tail -f /dev/null --pid=$$ & sleep 0.2; kill %1; echo done", language="bash")
    assert out(body) == "done\n"


def test_no_dnotify_and_no_userfaultfd(server, contained):
    """dnotify (fcntl's F_NOTIFY) would watch the shared read-only directories as inotify would; userfaultfd
    widens the races kernel exploits need. Both are refused; fcntl's other commands work."""
    code = """
import ctypes, errno, fcntl, os, platform
libc = ctypes.CDLL(None, use_errno=True)
fd = os.open('/usr', os.O_RDONLY)
try:
    fcntl.fcntl(fd, 1026, 0x80000001)  # F_NOTIFY, DN_ACCESS | DN_MULTISHOT
    print('dnotify allowed')
except OSError as e:
    print('dnotify', errno.errorcode[e.errno])
print('cloexec', fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC)
print('userfaultfd', libc.syscall({'x86_64': 323, 'aarch64': 282}[platform.machine()], 0),
      errno.errorcode.get(ctypes.get_errno()))
"""
    assert out(run(server, code)) == "dnotify EINVAL\ncloexec 1\nuserfaultfd -1 ENOSYS\n"


def test_a_program_cannot_lower_its_oom_priority(server, contained):
    code = """
for value in ('-1000', '0', '500'):
    try:
        with open('/proc/self/oom_score_adj', 'w') as f:
            f.write(value)
        print(value, 'written')
    except OSError as e:
        print(value, e.errno)
print(open('/proc/self/oom_score_adj').read().strip())
"""
    lines = out(run(server, code)).splitlines()
    assert lines[0] == "-1000 13", lines  # below the server's own floor: never
    with open("/proc/self/status") as f:
        effective = int(next(line.split()[1] for line in f if line.startswith("CapEff:")), 16)
    if not effective >> 24 & 1:  # the server is started by this test process, with its capabilities
        pytest.skip("the floor is set by a server holding CAP_SYS_RESOURCE; this host's root lacks it")
    assert lines[1:] == ["0 13", "500 13", "1000"], lines
