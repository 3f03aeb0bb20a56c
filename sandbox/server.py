"""The HTTP service: SandboxFusion-compatible `POST /run_code`, `GET /health`, and `/sessions`.

`create_app(settings)` builds the FastAPI app around a backend (backend.py): the settings and the backend
are the state its routes share, added in groups (health, runs, sessions) by the `_add_*` functions, and
ERROR_HANDLERS maps exceptions to answers. This module is the input boundary: bodies over
`max_request_bytes` and code over `max_code_bytes` -> 413, malformed or mistyped fields -> 422 naming the
field (a memory budget under the floor too), an unsupported language -> 400, `files` that do not fit a
run's /tmp (inodes, bytes, the file size limit, the memory budget that counts them) or a request that does
not fit the run's memory budget -> 413 naming the sizes and the limit, a missing or wrong bearer token ->
401, every worker busy with a full queue -> 503 with Retry-After, too many sessions -> 429. Session calls
get the same checks against their session's budget. A client's mistake is never answered as SandboxError,
which means the service failed. A client that disconnects mid-run gets its run killed. Run outcomes map
onto SandboxFusion's statuses (`to_response`). Sessions are reached only through the id their creator
received (sessions.py); GET /sessions gives counts.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import posixpath
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import Depends, FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from sandbox.backend import Backend, make_backend
from sandbox.models import (
    SUPPORTED_LANGUAGES,
    CommandRunResult,
    CommandRunStatus,
    RunCodeRequest,
    RunCodeResponse,
    RunStatus,
    SessionCreate,
    SessionInfo,
    SessionRunRequest,
)
from sandbox.pool import Overloaded
from sandbox.run import Job, Outcome
from sandbox.sessions import SessionError, SessionManager, session_frame
from sandbox.settings import INTERPRETER_MB, MB, REQUEST_COPIES, Settings
from sandbox.supervisor import inodes_for

log = logging.getLogger("sandbox.server")
T = TypeVar("T")
Authorize = Callable[[Request], Awaitable[None]]  # the bearer-token check, see _authorizer


class HTTPError(Exception):
    def __init__(self, status: int, detail: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(detail)
        self.status, self.detail, self.headers = status, detail, headers


class ClientGone(Exception):
    pass


def to_response(outcome: Outcome) -> RunCodeResponse:
    """SandboxFusion's mapping: Error -> SandboxError; time limit or non-zero exit -> Failed."""
    result = CommandRunResult(status=CommandRunStatus(outcome.status), execution_time=outcome.execution_time,
                              return_code=outcome.return_code, stdout=outcome.stdout, stderr=outcome.stderr)
    if outcome.status == "Error":
        status = RunStatus.SandboxError
    elif outcome.status == "TimeLimitExceeded" or outcome.return_code != 0:
        status = RunStatus.Failed
    else:
        status = RunStatus.Success
    return RunCodeResponse(status=status, message=outcome.message, run_result=result, files=outcome.files)


class BodyLimit:
    """ASGI middleware: refuse bodies over `limit` bytes with 413 before anything parses them."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[dict[str, Any]]],
                       send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit():
            if int(declared) > self.limit:
                return await self._refuse(send)
            return await self.app(scope, receive, send)  # the server enforces a declared length
        seen, refused = 0, False

        async def counting_receive() -> dict[str, Any]:
            nonlocal seen, refused
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit and not refused:  # a chunked body without Content-Length
                refused = True
                await self._refuse(send)
            return {"type": "http.disconnect"} if refused else message

        async def guarded_send(message: dict[str, Any]) -> None:
            if not refused:  # after our 413 the app's own answer has nowhere to go
                await send(message)

        await self.app(scope, counting_receive, guarded_send)

    async def _refuse(self, send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        body = JSONResponse({"detail": f"request body exceeds {self.limit} bytes"}, status_code=413)
        await send({"type": "http.response.start", "status": 413, "headers": body.raw_headers})
        await send({"type": "http.response.body", "body": body.body})


async def until_disconnect(work: Awaitable[T], request: Request) -> T:
    """Await `work` in this task unless the client disconnects first; then the task is cancelled
    (so is the run: it gets killed) and ClientGone raised. One watcher task, no extra waiting."""
    task = asyncio.current_task()
    assert task is not None
    watcher = asyncio.ensure_future(_disconnected(request))
    watcher.add_done_callback(lambda w: None if w.cancelled() else task.cancel())
    try:
        return await work
    except asyncio.CancelledError:
        if watcher.done() and not watcher.cancelled():
            raise ClientGone from None
        raise
    finally:
        watcher.cancel()


async def _disconnected(request: Request) -> None:
    # The body has been read; the server's receive() now blocks until the client goes away.
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(settings: Settings, backend: Backend | None = None) -> FastAPI:
    """The service around `backend` (by default the one `settings` picks). The settings and the backend are
    all the state the routes share; the lifespan starts and stops the backend."""
    backend = backend or make_backend(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await backend.start()
        log.info("sandbox ready: %s backend, %s", backend.name, backend.status())
        yield
        await backend.stop()

    app = FastAPI(title="agentrl sandbox", version="0.1.0", lifespan=lifespan,
                  exception_handlers=ERROR_HANDLERS)
    app.add_middleware(BodyLimit, limit=settings.max_request_bytes)
    authorized = _authorizer(settings)
    _add_health_route(app, backend)
    _add_run_route(app, settings, backend, authorized)
    _add_session_routes(app, settings, backend, authorized)
    return app


def _authorizer(settings: Settings) -> Authorize:
    """The bearer-token check (none without a token): /run_code awaits it, the session routes depend on it."""

    async def authorized(request: Request) -> None:
        if settings.token is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {settings.token}".encode()):
            raise HTTPError(401, "missing or wrong bearer token", {"WWW-Authenticate": "Bearer"})

    return authorized


async def _http_error(request: Request, exc: HTTPError) -> JSONResponse:
    return JSONResponse({"detail": exc.detail}, exc.status, headers=exc.headers)


async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    fields = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in errors)
    # not the offending input: it need not be JSON (1e400 parses as inf) and the client has it
    detail = jsonable_encoder([{k: v for k, v in e.items() if k != "input"} for e in errors])
    return JSONResponse({"detail": detail, "message": f"invalid request: {fields}"}, 422)


async def _overloaded(request: Request, exc: Overloaded) -> JSONResponse:
    return JSONResponse({"detail": f"sandbox overloaded: {exc}"}, 503, headers={"Retry-After": "1"})


async def _session_error(request: Request, exc: SessionError) -> JSONResponse:
    headers = {"Retry-After": "5"} if exc.status in (429, 503) else None
    return JSONResponse({"detail": str(exc)}, exc.status, headers=headers)


async def _gone(request: Request, exc: ClientGone) -> Response:
    return Response(status_code=499)  # nobody reads it; the run was killed


# How an exception raised while answering a request is answered (the statuses: the module docstring).
ERROR_HANDLERS: dict[Any, Callable[[Request, Any], Awaitable[Response]]] = {
    HTTPError: _http_error, RequestValidationError: _invalid, Overloaded: _overloaded,
    SessionError: _session_error, ClientGone: _gone,
}  # fmt: skip


def _add_health_route(app: FastAPI, backend: Backend) -> None:
    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "backend": backend.name, **backend.status()}


def _add_run_route(app: FastAPI, settings: Settings, backend: Backend, authorized: Authorize) -> None:
    # The hot path: the body is validated by pydantic-core straight from bytes and the answer serialised
    # the same way, skipping FastAPI's dependency and response-model machinery (about half of this
    # service's own time per request); the schema still shows in /docs.
    @app.post("/run_code", response_model=RunCodeResponse, openapi_extra=_body_schema(RunCodeRequest))
    async def run_code(request: Request) -> Response:
        await authorized(request)
        req = _parse(RunCodeRequest, await request.body())
        if req.language not in SUPPORTED_LANGUAGES:
            raise HTTPError(400, f"language {req.language!r} is not supported here; supported: "
                                 f"{', '.join(SUPPORTED_LANGUAGES)}")
        _check_code_size(req.code, settings)
        memory_mb = settings.clamp_memory(req.memory_limit_MB)
        file_bytes = _check_files_fit(req.files, settings, memory_mb)
        job = Job(code=req.code, language=req.language, timeout_s=settings.clamp_timeout(req.run_timeout),
                  memory_mb=memory_mb, stdin=req.stdin, files=req.files, fetch_files=req.fetch_files,
                  args=req.args)
        _check_memory_fits(len(job.payload), req.stdin, file_bytes, memory_mb, settings)
        outcome = await until_disconnect(backend.run(job), request)
        if outcome.refused:
            raise HTTPError(413, outcome.refused)
        return Response(to_response(outcome).model_dump_json(), media_type="application/json")


def _add_session_routes(app: FastAPI, settings: Settings, backend: Backend, authorized: Authorize) -> None:
    def sessions() -> SessionManager:
        if backend.sessions is None:
            raise HTTPError(400, f"sessions are not available with the {backend.name} backend "
                                 "(or max_sessions is 0); use the namespace backend")
        return backend.sessions

    @app.post("/sessions", status_code=201, response_model=SessionInfo, dependencies=[Depends(authorized)])
    async def create_session(req: SessionCreate | None = None) -> SessionInfo:
        req = req or SessionCreate()
        memory = settings.clamp_memory(req.memory_limit_MB if req.memory_limit_MB > 0
                                       else settings.session_memory_mb)
        session = await sessions().create(memory, req.idle_timeout)
        return SessionInfo(session_id=session.token, idle_timeout=session.idle_timeout, memory_limit_MB=memory)

    @app.post("/sessions/{session_id}/run_code", response_model=RunCodeResponse,
              dependencies=[Depends(authorized)])
    async def session_run(session_id: str, req: SessionRunRequest, request: Request) -> RunCodeResponse:
        _check_code_size(req.code, settings)
        manager = sessions()
        session = manager.get(session_id)  # 404 for an unknown id, and for another client's
        # the checks of /run_code, against the session's budget (its /tmp already holds earlier calls'
        # files: what no longer fits there is refused by the session itself, below)
        file_bytes = _check_files_fit(req.files, settings, session.memory_mb)
        frame = session_frame(req)
        _check_memory_fits(len(frame), req.stdin, file_bytes, session.memory_mb, settings)
        outcome = await until_disconnect(manager.call(session_id, frame, req.run_timeout), request)
        if outcome.refused:
            raise HTTPError(413, outcome.refused)
        return to_response(outcome)

    @app.delete("/sessions/{session_id}", status_code=204, dependencies=[Depends(authorized)])
    async def close_session(session_id: str) -> Response:
        manager = sessions()
        await manager.close(manager.get(session_id).id)  # 404 for an unknown id, and for another client's
        return Response(status_code=204)

    @app.get("/sessions", dependencies=[Depends(authorized)])
    async def count_sessions() -> dict[str, Any]:
        # counts only: a session is reachable through its id alone, which only its creator received
        return sessions().status()


M = TypeVar("M", bound=BaseModel)


def _parse(model: type[M], body: bytes) -> M:
    try:
        return model.model_validate_json(body)
    except ValidationError as e:  # the same 422 as FastAPI's own validation, locations under "body"
        raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in e.errors()]) from None


def _body_schema(model: type[BaseModel]) -> dict[str, Any]:
    schema = {"content": {"application/json": {"schema": model.model_json_schema()}}, "required": True}
    return {"requestBody": schema}


def _check_files_fit(files: dict[str, str | None], settings: Settings, memory_mb: int) -> None:
    """`files` must fit the run's /tmp: its inodes (the files, the directories holding them, the program
    file), its size (whole 4 KiB pages per file), the per-file size limit, and the memory budget, which
    counts /tmp's pages too. Returns the bytes they take in /tmp."""
    written = {posixpath.normpath(p): c for p, c in files.items() if c is not None}
    directories = {d for p in written for d in _parents(p)}
    inodes = inodes_for(settings.disk_mb) - 16  # the working dir, the program file, the run's own room
    if len(written) + len(directories) > inodes:
        raise HTTPError(413, f"files: {len(written)} files in {len(directories)} directories need more inodes "
                             f"than a run's /tmp has ({inodes} for files; --disk-mb {settings.disk_mb} gives 64 per MB)")
    sizes = {p: len(c) // 4 * 3 - c[-2:].count("=") for p, c in written.items()}
    largest = max(sizes, key=sizes.__getitem__, default=None)
    if largest is not None and sizes[largest] > settings.max_file_size_mb * MB:
        raise HTTPError(413, f"files: {largest!r} is {sizes[largest]} bytes; the file size limit is "
                             f"{settings.max_file_size_mb} MB")
    total = sum(-(-size // 4096) * 4096 for size in sizes.values())
    if total > min(settings.disk_mb, memory_mb) * MB:
        raise HTTPError(413, f"files: {total} bytes (in 4 KiB pages) exceed a run's /tmp of {settings.disk_mb} MB"
                             f" or its memory budget of {memory_mb} MB, which counts /tmp")
    return total


def _check_memory_fits(request_bytes: int, stdin: str | None, file_bytes: int, memory_mb: int,
                       settings: Settings) -> None:
    """The run's memory budget holds the request while the run is set up (stdin and base64 files are
    strings in it), the decoded files in /tmp and the interpreter: else its setup would be killed for
    memory, and the client would see a failure of the sandbox for what is its own request."""
    need = settings.setup_memory_bytes(request_bytes, file_bytes)
    if need > memory_mb * MB:
        stdin_bytes = len(stdin.encode()) if stdin else 0  # encodable: models.py checked
        raise HTTPError(413, f"the request does not fit the memory budget of {memory_mb} MB: stdin of {stdin_bytes} "
                             f"bytes and files of {file_bytes} bytes (decoded, in 4 KiB pages) need {-(-need // MB)} MB"
                             f" (the {request_bytes}-byte request is held {REQUEST_COPIES} times while the run is "
                             f"set up, the files once in /tmp, and the interpreter {INTERPRETER_MB} MB); ask for a "
                             f"larger memory_limit_MB (at most {settings.max_memory_mb}) or send less")


def _parents(path: str) -> list[str]:
    parts = path.split("/")[:-1]
    return ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _check_code_size(code: str, settings: Settings) -> None:
    size = len(code.encode("utf-8", errors="surrogatepass"))
    if size > settings.max_code_bytes:
        raise HTTPError(413, f"code is {size} bytes; the limit is {settings.max_code_bytes}")
