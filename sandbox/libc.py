"""Thin ctypes bindings to the Linux calls the isolation layer needs and Python 3.11 lacks.

Python 3.11 has no `os.unshare`, `os.setns`, `mount` or `pivot_root`; rootfs.py (the zygote's filesystem
view), zygote.py (the fork server), forker.py (the programs' forker), supervisor.py (a run's PID 1) and
program.py (the run's program) call them through this module, as well as the seccomp filter, the session
keyring, the loopback interface and openat2 (the supervisor's fetch of a run's files, which must not
follow links out of it).
Every wrapper raises OSError with the errno and the call's arguments, so a failure names what failed.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import platform
import socket
import struct

_libc = ctypes.CDLL(None, use_errno=True)

CLONE_PARENT = 0x00008000
CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_NOATIME = 1024
MS_NODIRATIME = 2048
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_RELATIME = 1 << 21
MNT_DETACH = 2

MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25  # Linux 6.1+
HUGE_PAGE = 2 << 20

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_CAPBSET_DROP = 24
PR_SET_SECUREBITS = 28
PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
# SECBIT_NOROOT | _LOCKED | SECBIT_NO_SETUID_FIXUP | _LOCKED | SECBIT_KEEP_CAPS_LOCKED:
# uid 0 never regains capabilities on execve (the single-uid fallback runs code as uid 0 in its namespace).
SECURE_NOROOT_ALL = 0x01 | 0x02 | 0x04 | 0x08 | 0x20

# None: the call does not exist on that architecture (aarch64 has only inotify_init1).
_SYSCALLS: dict[str, dict[str, int | None]] = {
    "x86_64": {"pivot_root": 155, "add_key": 248, "request_key": 249, "keyctl": 250, "syslog": 103,
               "openat2": 437, "socket": 41, "socketpair": 53, "inotify_init": 253, "inotify_init1": 294,
               "fanotify_init": 300, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
               "ptrace": 101, "clone": 56, "clone3": 435, "fcntl": 72, "userfaultfd": 323},
    "aarch64": {"pivot_root": 41, "add_key": 217, "request_key": 218, "keyctl": 219, "syslog": 116,
                "openat2": 437, "socket": 198, "socketpair": 199, "inotify_init": None, "inotify_init1": 26,
                "fanotify_init": 262, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
                "ptrace": 117, "clone": 220, "clone3": 435, "fcntl": 25, "userfaultfd": 282},
}
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
X32_SYSCALL_BIT = 0x40000000  # x86_64's x32 ABI: same numbers with this bit set
KEYCTL_JOIN_SESSION_KEYRING = 1
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
M_ARENA_MAX = -8
RESOLVE_NO_MAGICLINKS, RESOLVE_BENEATH = 0x02, 0x08


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def unshare(flags: int) -> None:
    _check(_libc.unshare(ctypes.c_int(flags)), f"unshare({flags:#x})")


def setns(fd: int, nstype: int) -> None:
    _check(_libc.setns(ctypes.c_int(fd), ctypes.c_int(nstype)), f"setns({fd}, {nstype:#x})")


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    def enc(s: str | None) -> bytes | None:
        return None if s is None else s.encode()

    result = _libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data))
    _check(result, f"mount({source!r}, {target!r}, {fstype!r}, {flags:#x}, {data!r})")


def umount2(target: str, flags: int) -> None:
    _check(_libc.umount2(target.encode(), ctypes.c_int(flags)), f"umount2({target!r})")


def _syscall_number(name: str) -> int:
    number = _SYSCALLS.get(platform.machine(), {}).get(name, -1)
    if number is None or number < 0:
        raise OSError(0, f"{name}: unsupported architecture {platform.machine()}")
    return number


def pivot_root(new_root: str, put_old: str) -> None:
    result = _libc.syscall(ctypes.c_long(_syscall_number("pivot_root")), new_root.encode(), put_old.encode())
    _check(result, f"pivot_root({new_root!r}, {put_old!r})")


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def open_beneath(dirfd: int, path: str, flags: int) -> int:
    """Open `path` relative to the directory `dirfd` without leaving it: an absolute path or link, a `..`
    above it, or a /proc magic link (`/proc/self/fd/N`, `/proc/N/root`) fails with EXDEV or ELOOP
    instead of being followed. Links that stay beneath `dirfd` are followed. Raises OSError.

    openat2 (Linux 5.6+); on older kernels every link on the way is refused (O_NOFOLLOW per component)."""
    if os.path.isabs(path):
        raise OSError(18, f"open_beneath({path!r}): an absolute path, expected one relative to the directory")
    how = _OpenHow(flags | os.O_CLOEXEC, 0, RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)
    fd = _libc.syscall(ctypes.c_long(_syscall_number("openat2")), ctypes.c_int(dirfd), path.encode(),
                       ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how)))
    if fd >= 0:
        return fd
    err = ctypes.get_errno()
    if err != 38:  # anything but ENOSYS: the kernel's verdict on this path
        raise OSError(err, f"openat2({path!r}, beneath): {os.strerror(err)}")
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise OSError(18, f"open_beneath({path!r}): '..' refused without openat2")
    current = dirfd
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            step = flags if last else os.O_PATH | os.O_DIRECTORY
            opened = os.open(part, step | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=current)
            if current != dirfd:
                os.close(current)
            current = opened
    except OSError:
        if current != dirfd:
            os.close(current)
        raise
    return current


def join_new_session_keyring() -> None:
    """Replace the caller's session keyring with a fresh, empty, anonymous one, so that nothing below it
    holds the keyring the server inherited from its login."""
    result = _libc.syscall(ctypes.c_long(_syscall_number("keyctl")), ctypes.c_long(KEYCTL_JOIN_SESSION_KEYRING),
                           ctypes.c_void_p(None))
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"keyctl(JOIN_SESSION_KEYRING): {os.strerror(err)}")


def deny_syscalls(names: tuple[str, ...], errno: int,
                   sockets: dict[int, tuple[int, ...] | None] | None = None,
                   rules: dict[str, tuple[int, str, int, int]] | None = None) -> None:
    """Install a seccomp filter under which the named system calls fail with `errno` (every other call
    is allowed), as does every call of another ABI than the native one (x86's i386 and x32, arm32), whose
    numbers the filter would not recognise. With `sockets` ({family: allowed protocols, or None for
    any}), socket() and socketpair() of any other family or protocol fail with EAFNOSUPPORT, as on a
    kernel built without that family. With `rules` ({name: (argument, test, value, errno)}), a call of
    `name` whose argument (its index; its low 32 bits) has any bit of `value` set (test "any_bits") or
    equals it ("equals") fails with that errno: clone with CLONE_PARENT, fcntl's F_NOTIFY. Names the
    architecture lacks are skipped. Inherited by every child and across execve; irrevocable. Needs
    PR_SET_NO_NEW_PRIVS first (or CAP_SYS_ADMIN)."""
    machine = platform.machine()
    if machine not in _AUDIT_ARCH:
        raise OSError(0, f"seccomp filter: unsupported architecture {machine}")
    count, filters = _assemble(_filter(machine, names, errno, sockets, rules or {}))
    buffer = ctypes.create_string_buffer(filters)

    class _Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    prog = _Prog(count, ctypes.addressof(buffer))
    zero = ctypes.c_ulong(0)
    result = _libc.prctl(ctypes.c_int(PR_SET_SECCOMP), ctypes.c_ulong(SECCOMP_MODE_FILTER),
                         ctypes.c_void_p(ctypes.addressof(prog)), zero, zero)
    _check(result, "prctl(PR_SET_SECCOMP)")


_Insn = tuple[int, "str | int", "str | int", int]  # (code, jump-if-true, jump-if-false, k); a jump may be a label


def _filter(machine: str, names: tuple[str, ...], errno: int, sockets: dict[int, tuple[int, ...] | None] | None,
            rules: dict[str, tuple[int, str, int, int]]) -> list[_Insn | str]:
    """deny_syscalls' BPF program, with labels. Jumps go forward only: the checks first, then the sections
    they jump to, `allow` last."""
    ld_w_abs, jeq_k, jge_k, jset_k, ret_k = 0x20, 0x15, 0x35, 0x45, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, JGE, JSET
    allow, deny = 0x7FFF0000, 0x00050000 | errno  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO | errno
    no_family = 0x00050000 | 97  # EAFNOSUPPORT
    nr, arch, arg0, arg2 = 0, 4, 16, 32  # offsets in struct seccomp_data (args: low 32 bits, little-endian)
    known = _SYSCALLS.get(machine, {})
    numbers = [n for name in names if (n := known.get(name)) is not None]
    ruled = {n: rule for name, rule in rules.items() if (n := known.get(name)) is not None}
    program: list[_Insn | str] = [(ld_w_abs, 0, 0, arch), (jeq_k, 0, "deny", _AUDIT_ARCH[machine]), (ld_w_abs, 0, 0, nr)]
    if machine == "x86_64":
        program.append((jge_k, "deny", 0, X32_SYSCALL_BIT))
    program += [(jeq_k, "deny", 0, n) for n in numbers]
    if sockets is not None:
        program += [(jeq_k, "socket", 0, _syscall_number(name)) for name in ("socket", "socketpair")]
    program += [(jeq_k, f"rule{n}", 0, n) for n in ruled]
    program += [(ret_k, 0, 0, allow), "deny", (ret_k, 0, 0, deny)]
    if sockets is not None:
        program += ["socket", (ld_w_abs, 0, 0, arg0)]
        for family, protocols in sockets.items():
            program.append((jeq_k, "allow" if protocols is None else f"family{family}", 0, family))
        program.append((ret_k, 0, 0, no_family))
        for family, protocols in sockets.items():
            if protocols is not None:
                program += [f"family{family}", (ld_w_abs, 0, 0, arg2)]
                program += [(jeq_k, "allow", 0, protocol) for protocol in protocols]
                program.append((ret_k, 0, 0, no_family))
    for n, (argument, test, value, err) in ruled.items():
        if test not in ("any_bits", "equals"):
            raise ValueError(f"seccomp rule for syscall {n}: test {test!r}, expected 'any_bits' or 'equals'")
        program += [f"rule{n}", (ld_w_abs, 0, 0, arg0 + 8 * argument),
                    (jset_k if test == "any_bits" else jeq_k, 0, "allow", value), (ret_k, 0, 0, 0x00050000 | err)]
    return [*program, "allow", (ret_k, 0, 0, allow)]


def _assemble(program: list[_Insn | str]) -> tuple[int, bytes]:
    """Labels resolved to relative jumps; returns the instruction count and the packed sock_filter array."""
    labels: dict[str, int] = {}
    for insn in program:
        if isinstance(insn, str):
            labels[insn] = sum(1 for i in program[:program.index(insn)] if not isinstance(i, str))
    code = [insn for insn in program if not isinstance(insn, str)]

    def jump(target: str | int, at: int) -> int:
        return target if isinstance(target, int) else labels[target] - at - 1  # relative to the next one

    return len(code), b"".join(struct.pack("HBBI", op, jump(jt, i), jump(jf, i), k)
                               for i, (op, jt, jf, k) in enumerate(code))


def loopback_up() -> None:
    """Bring up `lo` of the caller's (fresh) network namespace: 127.0.0.1 and ::1 work, nothing else."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sH22x", b"lo", 0)
        flags = struct.unpack("16sH22x", fcntl.ioctl(s, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags | IFF_UP))


def map_self_to_root(uid: int, gid: int) -> None:
    """In a user namespace the caller just entered: map its own outside uid and gid (the only ones an
    unprivileged process may map) to 0 inside, with setgroups denied as the kernel then requires."""
    for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def limit_malloc_arenas(count: int) -> None:
    """glibc reserves 64 MB of address space per thread arena; under RLIMIT_AS, cap their number."""
    _libc.mallopt(ctypes.c_int(M_ARENA_MAX), ctypes.c_int(count))


def prctl(option: int, arg: int = 0) -> None:
    zero = ctypes.c_ulong(0)
    _check(_libc.prctl(ctypes.c_int(option), ctypes.c_ulong(arg), zero, zero, zero), f"prctl({option}, {arg})")


_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


def collapse_to_huge_pages() -> int:
    """Back this process's anonymous memory with 2 MB pages where the kernel can (MADV_COLLAPSE, Linux
    6.1+; elsewhere nothing happens). Returns the bytes collapsed.

    For the forker: fork copies, and exit tears down, one page-table entry per 4 KB page of the parent's
    memory; collapsed, one entry covers 2 MB, so forking and reaping a child cost a fraction. A child's
    write to a shared huge page splits it and copies only the 4 KB it touched, as before."""
    done = 0
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if fields[1] != "rw-p" or (len(fields) > 5 and fields[5] != "[heap]"):
                continue  # private anonymous memory only: the heap and the allocator's arenas
            start, end = (int(x, 16) for x in fields[0].split("-"))
            lo, hi = (start + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1), end & ~(HUGE_PAGE - 1)
            if hi - lo < HUGE_PAGE:
                continue
            _libc.madvise(lo, hi - lo, MADV_HUGEPAGE)  # best effort: a region may refuse either call
            if _libc.madvise(lo, hi - lo, MADV_COLLAPSE) == 0:
                done += hi - lo
    return done


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def drop_all_capabilities() -> None:
    """Empty the bounding, effective, permitted and inheritable sets and lock uid 0 out of regaining them.

    Needed only in the single-uid fallback, where the run keeps uid 0 inside its user namespace."""
    prctl(PR_SET_SECUREBITS, SECURE_NOROOT_ALL)
    cap = 0
    while True:  # drop until the kernel says the capability number does not exist
        if _libc.prctl(ctypes.c_int(PR_CAPBSET_DROP), ctypes.c_ulong(cap), 0, 0, 0) != 0:
            break
        cap += 1
    header = _CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3: two 32-bit words
    data = (_CapData * 2)()
    _check(_libc.capset(ctypes.byref(header), ctypes.byref(data)), "capset(empty)")


def bind_flags_of(path: str) -> int:
    """The mount flags a read-only remount of a bind of `path` must keep: a user namespace may not
    clear nosuid/nodev/noexec or change atime flags inherited from a more privileged mount."""
    st = os.statvfs(path)
    flags = 0
    for st_flag, ms_flag in (
        (os.ST_NOSUID, MS_NOSUID),
        (os.ST_NODEV, MS_NODEV),
        (os.ST_NOEXEC, MS_NOEXEC),
        (os.ST_NOATIME, MS_NOATIME),
        (os.ST_NODIRATIME, MS_NODIRATIME),
        (os.ST_RELATIME, MS_RELATIME),
    ):
        if st.f_flag & st_flag:
            flags |= ms_flag
    return flags
