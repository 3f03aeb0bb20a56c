"""The `python` tool: runs the model's code in the sandbox service (sandbox/) over HTTP.

`CodeTool` implements the Tool protocol (tools/__init__.py): `call(ToolCall("python", {"code": ...}))`
posts SandboxFusion's `/run_code` request, so it works against our sandbox and against a real
SandboxFusion server alike, and turns the answer into a `ToolResult` (agentrl/types.py). It never raises
for a failure (a failed call is an observation the model sees): a non-zero exit is `execution_error`, a
time limit `timeout`, a refused request `http_<code>`, an unreachable service `connection`, a sandbox-side failure
`sandbox_error`, each with a text the model sees. Connection errors and 5xx/429 answers are retried a
bounded number of times with jittered backoff (honouring Retry-After), over about 8 s by default: longer
than a managed sandbox that died takes to be restarted (services.py), so its calls land there. At most
`concurrency` requests are in flight. `CodeTool.session()` opens a stateful session (our sandbox only: `/sessions`).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx

from agentrl.tools.http import http_url
from agentrl.types import ToolCall, ToolResult

RETRYABLE_STATUS = {429, 500, 502, 503, 504}


class CodeTool:
    name = "python"

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8080",
        *,
        language: str = "python",
        run_timeout: float = 10.0,
        memory_limit_mb: int = -1,
        max_retries: int = 5,
        backoff_s: float = 0.25,
        concurrency: int = 64,
        queue_margin_s: float = 60.0,
        token: str | None = None,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        self.base_url = http_url(base_url, "the sandbox's URL").rstrip("/")
        self.language = language
        self.run_timeout = run_timeout
        self.memory_limit_mb = memory_limit_mb
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        # A run may wait in the server's queue before it starts: reads get the run time plus a margin.
        timeout = httpx.Timeout(run_timeout + queue_margin_s, connect=5.0)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        self._client = client or httpx.AsyncClient(timeout=timeout, headers=headers, limits=limits)
        self._owns_client = client is None
        self._slots = asyncio.Semaphore(concurrency)

    async def call(self, call: ToolCall) -> ToolResult:
        code = call.arguments.get("code")
        if not isinstance(code, str):
            return _no_code()
        payload = {
            "code": code,
            "language": self.language,
            "run_timeout": self.run_timeout,
            "memory_limit_MB": self.memory_limit_mb,
            "stdin": call.arguments.get("stdin"),
            "files": call.arguments.get("files") or {},
            "fetch_files": call.arguments.get("fetch_files") or [],
        }
        return await self._post("/run_code", payload)

    async def _post(self, path: str, payload: dict[str, Any]) -> ToolResult:
        started = time.monotonic()
        attempts = 0
        async with self._slots:
            while True:
                attempts += 1
                failure: ToolResult | None = None
                retry_after: float | None = None
                try:
                    response = await self._client.post(self.base_url + path, json=payload)
                except httpx.TimeoutException as e:
                    if isinstance(e, httpx.ConnectTimeout):
                        failure = _failure("connection", f"could not connect to the sandbox: {e!r}")
                    else:  # the service took the request; re-sending would run the code twice
                        return _failure("no_answer", f"the sandbox did not answer in time ({e!r})",
                                        started, attempts)
                except httpx.TransportError as e:
                    failure = _failure("connection", f"could not reach the sandbox at {self.base_url}: {e!r}")
                else:
                    if response.status_code == 200:
                        return _from_response(response, started, attempts)
                    failure = _failure(f"http_{response.status_code}", _http_text(response))
                    if response.status_code not in RETRYABLE_STATUS:
                        return _with(failure, started, attempts)
                    retry_after = _retry_after(response)
                if attempts > self.max_retries:
                    return _with(failure, started, attempts)
                delay = self.backoff_s * 2 ** (attempts - 1) * (0.5 + random.random())
                await asyncio.sleep(min(10.0, max(delay, retry_after or 0.0)))

    @asynccontextmanager
    async def session(self, memory_limit_mb: int = -1) -> AsyncIterator[CodeSession]:
        """A stateful session on our sandbox (variables persist across calls); closed on exit."""
        response = await self._client.post(f"{self.base_url}/sessions", json={"memory_limit_MB": memory_limit_mb})
        response.raise_for_status()
        session = CodeSession(self, response.json()["session_id"])
        try:
            yield session
        finally:
            try:
                await session.aclose()
            except httpx.HTTPError:
                pass  # the server closes idle sessions itself

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()


class CodeSession:
    """The `python` tool bound to one server-side session (a Tool too). The session's id is its only
    handle (the server lists no ids): it stays with this object."""

    name = "python"

    def __init__(self, tool: CodeTool, session_id: str) -> None:
        self.tool, self.id = tool, session_id

    async def call(self, call: ToolCall) -> ToolResult:
        code = call.arguments.get("code")
        if not isinstance(code, str):
            return _no_code()
        payload = {"code": code, "run_timeout": self.tool.run_timeout, "stdin": call.arguments.get("stdin")}
        return await self.tool._post(f"/sessions/{self.id}/run_code", payload)

    async def aclose(self) -> None:
        await self.tool._client.delete(f"{self.tool.base_url}/sessions/{self.id}")


def _no_code() -> ToolResult:
    return ToolResult(text="Error: the python tool needs a string argument 'code'.", error="malformed")


def _from_response(response: httpx.Response, started: float, attempts: int) -> ToolResult:
    try:
        body = response.json()
        status = body["status"]
        run = body.get("run_result") or {}
        if not isinstance(run, dict):
            raise TypeError("run_result is not an object")
    except (ValueError, KeyError, TypeError, AttributeError):  # AttributeError: a body that is not an object
        return _failure("sandbox_error", f"the sandbox sent an unreadable answer: {response.text[:200]!r}",
                        started, attempts)
    stdout, stderr = run.get("stdout") or "", run.get("stderr") or ""
    metadata = {"stdout": stdout, "stderr": stderr, "return_code": run.get("return_code"),
                "execution_time": run.get("execution_time"), "status": run.get("status") or status,
                "attempts": attempts}
    latency = time.monotonic() - started
    if status == "SandboxError" or run.get("status") == "Error" or not run:
        text = f"Sandbox error: {body.get('message') or stderr or 'the sandbox failed to run the code'}"
        return ToolResult(text=text, error="sandbox_error", latency_s=latency, metadata=metadata)
    if run.get("status") == "TimeLimitExceeded":
        text = _join(stdout, stderr, "Timeout: the code ran longer than its time limit and was stopped.")
        return ToolResult(text=text, error="timeout", latency_s=latency, metadata=metadata)
    if status == "Failed" or run.get("return_code") not in (0, None):
        return ToolResult(text=_join(stdout, stderr), error="execution_error", latency_s=latency,
                          metadata=metadata)
    return ToolResult(text=stdout, latency_s=latency, metadata=metadata)


def _join(*parts: str) -> str:
    return "\n".join(p.rstrip("\n") for p in parts if p)


def _http_text(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        body = None
    detail = (body.get("message") or body.get("detail")) if isinstance(body, dict) else response.text[:300]
    return f"Sandbox refused the request (HTTP {response.status_code}): {detail}"


def _retry_after(response: httpx.Response) -> float | None:
    try:
        return float(response.headers.get("retry-after", ""))
    except ValueError:
        return None


def _failure(kind: str, text: str, started: float | None = None, attempts: int = 1) -> ToolResult:
    result = ToolResult(text=text if text.startswith(("Sandbox", "Error")) else f"Sandbox unavailable: {text}",
                        error=kind, metadata={"attempts": attempts})
    return result if started is None else _with(result, started, attempts)


def _with(result: ToolResult, started: float, attempts: int) -> ToolResult:
    return ToolResult(text=result.text, error=result.error, latency_s=time.monotonic() - started,
                      metadata={**result.metadata, "attempts": attempts})
