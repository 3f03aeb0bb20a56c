"""The HTTP schema: SandboxFusion's `/run_code` request and response, and our `/sessions` calls.

Field names, defaults and status values follow SandboxFusion (bytedance/SandboxFusion,
sandbox/server/sandbox_api.py and sandbox/runners/types.py), so ToRL and veRL clients work unchanged.
`language` is a plain string here: an unsupported one is answered 400 with the supported list (server.py)
rather than a 422 enum error. Paths in `files` must stay inside the working directory; `fetch_files` may
name any path (one that cannot be fetched is left out of the answer, as in SandboxFusion).
"""

from __future__ import annotations

import base64
import binascii
import posixpath
from enum import Enum

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from sandbox.settings import MIN_MEMORY_MB

SUPPORTED_LANGUAGES = ("python", "bash")
NAME_MAX, PATH_MAX = 255, 4096  # Linux's limits on a file name and a path, in bytes
ARG_STRLEN = 131072  # Linux's limit on one argv string, NUL included
ARGV_BYTES = 1 << 20  # all of a run's args together (the kernel's ARG_MAX also counts the environment)


def _check_relative(path: str) -> str:
    normal = posixpath.normpath(path)
    if not path or path.startswith("/") or normal == ".." or normal.startswith("../") or normal == ".":
        raise ValueError(f"{path!r} must be a relative path inside the working directory")
    if "\x00" in path:
        raise ValueError(f"{path!r} contains a NUL byte")
    if any(len(part.encode()) > NAME_MAX for part in path.split("/")) or len(path.encode()) > PATH_MAX:
        raise ValueError(f"{path[:60]!r}...: a path component is longer than {NAME_MAX} bytes or the path than {PATH_MAX}")
    return path


def _check_memory(memory_mb: int) -> int:
    if 0 < memory_mb < MIN_MEMORY_MB:
        raise ValueError(f"memory_limit_MB is {memory_mb}; the floor is {MIN_MEMORY_MB} MB, the least the interpreter "
                         "needs to start and run a small program (<= 0 means the server default)")
    return memory_mb


class _Program(BaseModel):
    """What both one-shot runs and session calls carry."""

    model_config = ConfigDict(extra="ignore")  # SandboxFusion clients may send fields we do not use

    code: str = Field(..., description="the code to run")
    stdin: str | None = Field(None, description="text fed to standard input")
    files: dict[str, str | None] = Field(default_factory=dict, description="relative path -> base64 content")
    fetch_files: list[str] = Field(default_factory=list,
                                   description="paths (relative to the working dir, or absolute under /tmp) "
                                               "returned base64-encoded after the run")

    @field_validator("stdin")
    @classmethod
    def _stdin(cls, stdin: str | None) -> str | None:
        if stdin is not None:  # JSON can carry lone surrogates ("\ud800"); the run's stdin is UTF-8 bytes
            try:
                stdin.encode()
            except UnicodeEncodeError as e:
                raise ValueError(f"stdin is not encodable as UTF-8 (a lone surrogate at {e.start})") from None
        return stdin

    @field_validator("files")
    @classmethod
    def _files(cls, files: dict[str, str | None]) -> dict[str, str | None]:
        for path, content in files.items():
            _check_relative(path)
            if content is not None:
                try:
                    base64.b64decode(content, validate=True)
                except (binascii.Error, ValueError) as e:
                    raise ValueError(f"content of {path!r} is not valid base64: {e}") from None
        normal = sorted(posixpath.normpath(p) for p in files)
        for a, b in zip(normal, normal[1:], strict=False):
            if b == a or b.startswith(a + "/"):
                raise ValueError(f"{a!r} and {b!r} collide: one file's path is (or is inside) another's")
        return files


class RunCodeRequest(_Program):
    language: str = Field(..., description="python or bash")
    compile_timeout: float = Field(10, gt=0, description="accepted for compatibility; nothing is compiled")
    run_timeout: float = Field(10, gt=0, description="wall-clock seconds (clamped to the server's maximum)")
    # strict: JSON `true` is not a memory budget (lax mode would read it as 1 MB)
    memory_limit_MB: int = Field(-1, strict=True, description="memory budget in MB; <= 0 means the server "
                                                              f"default; else at least {MIN_MEMORY_MB}")
    args: list[str] = Field(default_factory=list, description="extra argv (sys.argv[1:] / $1...)")

    @field_validator("memory_limit_MB")
    @classmethod
    def _memory(cls, memory_mb: int) -> int:
        return _check_memory(memory_mb)

    @model_validator(mode="after")
    def _bash_argv(self) -> RunCodeRequest:
        """bash gets its args as argv strings, which the kernel bounds and cuts at NUL. (Python's stay
        strings in the warm interpreter; both read their code from a file.)"""
        if self.language != "bash":
            return self
        total = 0
        for i, text in enumerate(self.args):
            if "\x00" in text:
                raise ValueError(f"args[{i}] contains a NUL byte, which a bash argument cannot hold")
            size = len(text.encode())
            if size >= ARG_STRLEN:
                raise ValueError(f"args[{i}] is {size} bytes; bash takes at most {ARG_STRLEN - 1} in one argument")
            total += size + 1
        if total > ARGV_BYTES:
            raise ValueError(f"bash args are {total} bytes together; at most {ARGV_BYTES}")
        return self


class SessionRunRequest(_Program):
    run_timeout: float = Field(10, gt=0, description="wall-clock seconds for this call")


class RunStatus(str, Enum):
    Success = "Success"  # finished with return code 0
    Failed = "Failed"  # non-zero return code or time limit exceeded
    SandboxError = "SandboxError"  # the sandbox itself failed


class CommandRunStatus(str, Enum):
    Finished = "Finished"
    Error = "Error"
    TimeLimitExceeded = "TimeLimitExceeded"


class CommandRunResult(BaseModel):
    status: CommandRunStatus
    execution_time: float | None = None
    return_code: int | None = None
    stdout: str | None = None
    stderr: str | None = None


class RunCodeResponse(BaseModel):
    status: RunStatus
    message: str = ""
    compile_result: CommandRunResult | None = None
    run_result: CommandRunResult | None = None
    executor_pod_name: str | None = None
    files: dict[str, str] = Field(default_factory=dict)


class SessionCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    memory_limit_MB: int = Field(-1, strict=True, description="memory budget of the session; <= 0: server "
                                                              f"default; else at least {MIN_MEMORY_MB}")
    idle_timeout: float | None = Field(None, gt=0, allow_inf_nan=False,
                                       description="seconds unused before it is closed; at most the server's --max-session-idle")

    @field_validator("memory_limit_MB")
    @classmethod
    def _memory(cls, memory_mb: int) -> int:
        return _check_memory(memory_mb)


class SessionInfo(BaseModel):
    session_id: str
    idle_timeout: float
    memory_limit_MB: int
