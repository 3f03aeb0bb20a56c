"""The filesystem every run sees: a read-only tmpfs root holding only what programs need.

The server decides the view (`RootSpec.default`); the zygote (zygote.py) captures the host sources
(`HostSnapshot.capture`, run before it leaves the host's namespaces, so it can open paths such as a
Python under a 0700 /root) and then builds the root in its private mount namespace (`build_root`).
A run (supervisor.py) adds only its own scratch tmpfs on /tmp (binding again what the view holds under
/tmp, such as a venv of a repository cloned there) and a fresh /proc.

What is in the view: /usr and the /bin, /lib* symlinks or binds; the Python installation(s) serving
the zygote, at their host paths; a synthetic /etc (world-readable essentials copied, passwd/group/hosts
written fresh, never shadow files or keys); a minimal /dev. Everything is read-only and nosuid.
What is not: /home, /root (except a bound Python prefix), /work, /srv, /var, /sys, the repository.
"""

from __future__ import annotations

import os
import site
import stat
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from sandbox import libc

# Copied when world-readable (or re-created when a symlink); never shadow, gshadow or private keys.
ETC_FILES = (
    "ld.so.cache", "ld.so.conf", "nsswitch.conf", "localtime", "timezone", "os-release", "debian_version",
    "mime.types", "protocols", "services", "host.conf", "gai.conf", "inputrc", "magic", "magic.mime",
    "networks", "ethertypes", "bash.bashrc", "profile",
)
ETC_DIRS = ("alternatives", "ld.so.conf.d", "ssl/certs", "ca-certificates", "fonts")
DEVICES = ("null", "zero", "full", "random", "urandom")
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/opt/conda")


@dataclass
class RootSpec:
    """What the zygote's root contains; JSON-serialisable so the server can send it to the zygote."""

    binds: list[str]  # host paths bound read-only at the same path (or re-created symlinks at top level)
    uid: int  # the sandbox user's uid inside the namespace, written into /etc/passwd
    gid: int
    hostname: str = "sandbox"
    extra_etc: dict[str, str] = field(default_factory=dict)

    @classmethod
    def default(cls, uid: int, gid: int, extra_binds: tuple[str, ...] = ()) -> RootSpec:
        wanted = [*SYSTEM_DIRS, sys.base_prefix, sys.prefix, *site.getsitepackages(), *extra_binds]
        binds: list[str] = []
        for path in wanted:
            path = os.path.abspath(path)
            if os.path.lexists(path) and not any(_inside(path, b) for b in binds):
                binds = [b for b in binds if not _inside(b, path)] + [path]
        return cls(binds=binds, uid=uid, gid=gid)

    @property
    def tmp_binds(self) -> list[str]:
        """Binds under /tmp (a repository cloned there, with its venv): every run mounts its own tmpfs on
        /tmp, so each run binds these again on top of it (supervisor.py)."""
        return [path for path in self.binds if _inside(path, "/tmp")]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _inside(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


@dataclass
class HostSnapshot:
    """Host-side handles taken before the zygote unshares: O_PATH fds for bind sources (usable later
    through /proc/self/fd even where the path is not traversable by the namespace's uids) and the
    bytes of the /etc files to copy."""

    spec: RootSpec
    bind_fds: dict[str, int]  # target path -> O_PATH fd of its source
    symlinks: dict[str, str]  # top-level path -> link target
    etc_copies: dict[str, bytes]
    etc_links: dict[str, str]
    etc_dir_fds: dict[str, int]
    device_fds: dict[str, int]

    @classmethod
    def capture(cls, spec: RootSpec) -> HostSnapshot:
        def opath(path: str) -> int:
            return os.open(path, os.O_PATH | os.O_CLOEXEC)

        bind_fds: dict[str, int] = {}
        symlinks: dict[str, str] = {}
        for path in spec.binds:
            if os.path.islink(path) and os.path.dirname(path) == "/":
                symlinks[path] = os.readlink(path)  # /bin -> usr/bin on merged-/usr systems
            elif os.path.exists(path):
                bind_fds[path] = opath(os.path.realpath(path))
        etc_copies: dict[str, bytes] = {}
        etc_links: dict[str, str] = {}
        for name in ETC_FILES:
            path = os.path.join("/etc", name)
            if os.path.islink(path):
                etc_links[name] = os.readlink(path)
            elif os.path.isfile(path) and os.stat(path).st_mode & stat.S_IROTH:
                with open(path, "rb") as f:
                    etc_copies[name] = f.read()
        etc_dir_fds = {
            name: opath(os.path.join("/etc", name))
            for name in ETC_DIRS
            if os.path.isdir(os.path.join("/etc", name))
            and os.stat(os.path.join("/etc", name)).st_mode & stat.S_IROTH
        }
        device_fds = {name: opath(f"/dev/{name}") for name in DEVICES if os.path.exists(f"/dev/{name}")}
        return cls(spec, bind_fds, symlinks, etc_copies, etc_links, etc_dir_fds, device_fds)


def _synthetic_etc(spec: RootSpec) -> dict[str, bytes]:
    uid, gid = spec.uid, spec.gid
    files = {
        "passwd": f"root:x:0:0:root:/root:/bin/bash\nsandbox:x:{uid}:{gid}:sandbox:/tmp/work:/bin/bash\n"
        "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
        "group": f"root:x:0:\nsandbox:x:{gid}:\nnogroup:x:65534:\n",
        "hosts": f"127.0.0.1\tlocalhost\n::1\tlocalhost\n127.0.1.1\t{spec.hostname}\n",
        "hostname": f"{spec.hostname}\n",
        "resolv.conf": "",  # no network: an empty resolver config fails fast instead of timing out
        **spec.extra_etc,
    }
    return {name: text.encode() for name, text in files.items()}


def _bind(fd: int, target: str, readonly: bool = True) -> None:
    libc.mount(f"/proc/self/fd/{fd}", target, None, libc.MS_BIND | libc.MS_REC)
    if readonly:
        keep = libc.bind_flags_of(target)
        flags = libc.MS_REMOUNT | libc.MS_BIND | libc.MS_RDONLY | libc.MS_NOSUID | keep
        libc.mount(None, target, None, flags)


def _mount_target(path: str, like_fd: int) -> None:
    """Create an empty file or directory at `path` to bind onto, matching the source's kind."""
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    if stat.S_ISDIR(os.fstat(like_fd).st_mode):
        os.makedirs(path, mode=0o755, exist_ok=True)
    else:
        with open(path, "wb"):
            pass


def build_root(snap: HostSnapshot, stage: str = "/tmp") -> None:
    """Assemble the root on a tmpfs at `stage`, mount a fresh /proc for the caller's PID namespace,
    pivot into it and make it read-only. The caller must be in its own user and mount namespaces."""
    libc.mount(None, "/", None, libc.MS_REC | libc.MS_PRIVATE)  # nothing we mount leaks to the host
    libc.mount("tmpfs", stage, "tmpfs", libc.MS_NOSUID | libc.MS_NODEV, "size=16m,mode=0755")
    os.umask(0o022)
    root = stage.rstrip("/")
    for name in ("proc", "dev", "etc", "tmp"):
        os.mkdir(f"{root}/{name}", 0o755)
    for path, target in snap.symlinks.items():
        os.symlink(target, root + path)
    for path, fd in snap.bind_fds.items():
        _mount_target(root + path, fd)
        _bind(fd, root + path)
    for name, data in {**snap.etc_copies, **_synthetic_etc(snap.spec)}.items():
        with open(f"{root}/etc/{name}", "wb") as f:
            f.write(data)
    for name, target in snap.etc_links.items():
        if not os.path.lexists(f"{root}/etc/{name}"):
            os.symlink(target, f"{root}/etc/{name}")
    for name, fd in snap.etc_dir_fds.items():
        _mount_target(f"{root}/etc/{name}", fd)
        _bind(fd, f"{root}/etc/{name}")
    for name, fd in snap.device_fds.items():
        _mount_target(f"{root}/dev/{name}", fd)
        _bind(fd, f"{root}/dev/{name}", readonly=False)  # /dev/null must stay writable
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2"), ("shm", "/tmp")):
        os.symlink(target, f"{root}/dev/{name}")
    libc.mount("proc", f"{root}/proc", "proc", libc.MS_NOSUID | libc.MS_NODEV | libc.MS_NOEXEC)
    for fd in (*snap.bind_fds.values(), *snap.etc_dir_fds.values(), *snap.device_fds.values()):
        os.close(fd)
    os.chdir(root)
    libc.pivot_root(".", ".")  # the old root ends up stacked under the new one: detach it
    libc.umount2(".", libc.MNT_DETACH)
    os.chdir("/")
    libc.mount(None, "/", None, libc.MS_REMOUNT | libc.MS_RDONLY | libc.MS_NOSUID | libc.MS_NODEV)
