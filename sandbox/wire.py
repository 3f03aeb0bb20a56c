"""The byte formats spoken between the server (pool.py, sessions.py), the zygotes (zygote.py) and the
confined runs (supervisor.py, program.py).

Control messages travel on a SOCK_SEQPACKET socket, one JSON object per packet, with file descriptors
attached as SCM_RIGHTS. Session calls travel on a stream socket as length-prefixed JSON frames. A one-shot
run reads its request from a stream socket until EOF and writes its report the same way.
"""

from __future__ import annotations

import json
import os
import socket
import struct
from typing import Any

MAX_CONTROL_BYTES = 64 * 1024
FRAME_HEADER = struct.Struct(">I")


def send_msg(sock: socket.socket, msg: dict[str, Any], fds: list[int] | None = None) -> None:
    data = json.dumps(msg).encode()
    if fds:
        socket.send_fds(sock, [data], fds)
    else:
        sock.send(data)


def recv_msg(sock: socket.socket, max_fds: int = 8) -> tuple[dict[str, Any] | None, list[int]]:
    """One control message and its descriptors; (None, []) when the peer has gone."""
    data, fds, _flags, _addr = socket.recv_fds(sock, MAX_CONTROL_BYTES, max_fds)
    if not data:
        for fd in fds:
            os.close(fd)
        return None, []
    return json.loads(data), fds


def encode_frame(msg: dict[str, Any]) -> bytes:
    data = json.dumps(msg).encode()
    return FRAME_HEADER.pack(len(data)) + data


def read_exact_fd(fd: int, n: int) -> bytes | None:
    chunks: list[bytes] = []
    while n:
        chunk = os.read(fd, min(n, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def read_frame_fd(fd: int, limit: int) -> dict[str, Any] | None:
    """A length-prefixed JSON frame from a blocking fd; None at EOF. Frames over `limit` are refused."""
    head = read_exact_fd(fd, FRAME_HEADER.size)
    if head is None:
        return None
    (length,) = FRAME_HEADER.unpack(head)
    if length > limit:
        raise ValueError(f"frame of {length} bytes exceeds the {limit}-byte limit")
    body = read_exact_fd(fd, length)
    return None if body is None else json.loads(body)


def read_all_fd(fd: int, limit: int) -> bytes:
    chunks: list[bytes] = []
    total = 0
    while chunk := os.read(fd, 1 << 20):
        total += len(chunk)
        if total > limit:
            raise ValueError(f"request exceeds the {limit}-byte limit")
        chunks.append(chunk)
    return b"".join(chunks)


def write_all_fd(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
