"""The `search` tool: an async client of the retrieval service (retriever/) or of Search-R1's own server.

`SearchTool.call(ToolCall("search", {"query": ...}))` posts `{"queries": [q], "topk": k, "return_scores":
true}` to `/retrieve` (true because Search-R1's server fails without it) and formats the passages the way
Search-R1's rollout does, one per line: `Doc {i}(Title: {title}) {text}`, the title being the first line
of `contents` as it is (wiki-18 writes it in quotes, and Search-R1's models saw the quotes). Either item
shape is read: `{"document": {...}, "score"}` or a bare document.

`batch()` sends many queries in one request, or in several when they exceed what the server takes in one:
the tool reads the server's limits from `GET /health` (`limits`: queries, queries x topk and body bytes
per request) before its first batch of several queries, splits to fit, sends the parts at once and returns the results in
order. A server that states no limits (Search-R1's has no `/health`) gets one request. A 413 answer
means the limits changed (the server restarted with others): they are read again and the batch is split
anew, once.

Failures never raise out of `call` or `batch`, since a rollout must go on when a tool fails: a timeout, a
5xx or a refused connection is retried a bounded number of times with exponential backoff (7.5 s in all
by default: a managed retriever that died is restarted within it, unless its index is slow to load), then becomes
a ToolResult whose `error` is "no_answer", "http_503", "connection", ... and whose text tells the model the
search failed. The rollout renders the text inside `<information>` (tools/formats.py).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any
from urllib.parse import urlsplit

import httpx

from agentrl.tools.http import http_url
from agentrl.types import ToolCall, ToolResult

DEFAULT_URL = "http://127.0.0.1:8000/retrieve"


def split_title(contents: str) -> tuple[str, str]:
    """`"\"Title\"\ntext"` -> ("\"Title\"", "text"): Search-R1's `_passages2string` split, first line
    verbatim."""
    first, _, rest = contents.partition("\n")
    return first, rest


def format_passages(documents: list[dict[str, Any]]) -> str:
    """Search-R1's `_passages2string`, without its trailing newline (the rollout strips it anyway)."""
    lines = []
    for i, doc in enumerate(documents, 1):
        title, text = split_title(str(doc.get("contents", "")))
        lines.append(f"Doc {i}(Title: {title}) {text}")
    return "\n".join(lines)


def _documents(items: list[Any]) -> tuple[list[dict[str, Any]], list[float | None]]:
    docs, scores = [], []
    for item in items:
        if isinstance(item, dict) and isinstance(item.get("document"), dict):
            docs.append(item["document"])
            scores.append(item.get("score"))
        elif isinstance(item, dict):
            docs.append(item)
            scores.append(None)
        else:
            raise ValueError(f"a result item is {type(item).__name__}, expected an object")
    return docs, scores


def retrieve_url(url: str) -> str:
    """Accept the server's base URL or its /retrieve endpoint."""
    return url.rstrip("/") + "/retrieve" if urlsplit(url).path in ("", "/") else url


def health_url(url: str) -> str:
    """The /health endpoint beside a /retrieve endpoint."""
    return url.rsplit("/", 1)[0] + "/health"


def split_queries(queries: list[str], topk: int, limits: dict[str, int]) -> list[list[str]]:
    """`queries` cut, in order, into runs that each fit the server's `limits` (those it states: the most
    queries, queries x topk and body bytes in one request)."""
    most = limits.get("max_queries") or len(queries)
    if limits.get("max_results"):
        most = min(most, max(1, limits["max_results"] // max(topk, 1)))
    budget = limits.get("max_body_bytes") or 0
    envelope = len(json.dumps({"queries": [], "topk": topk, "return_scores": True}))
    chunks: list[list[str]] = [[]]
    size = envelope
    for query in queries:
        cost = len(json.dumps(query).encode()) + 2  # the query and its ", " separator
        if chunks[-1] and (len(chunks[-1]) == most or (budget and size + cost > budget)):
            chunks.append([])
            size = envelope
        chunks[-1].append(query)
        size += cost
    return chunks


class SearchTool:
    name = "search"

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        topk: int = 3,
        timeout_s: float = 10.0,
        max_retries: int = 4,
        backoff_s: float = 0.5,
        client: httpx.AsyncClient | None = None,
    ) -> None:
        self.url = retrieve_url(http_url(url, "the retrieval service's URL"))
        self.topk = topk
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
        self._client = client or httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), limits=limits)
        self._owns_client = client is None  # a lent client is its owner's to close
        self._limits: dict[str, int] | None = None  # the server's, from /health; None until read

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()

    async def call(self, call: ToolCall) -> ToolResult:
        query = call.arguments.get("query")
        if not isinstance(query, str) or not query.strip():
            return ToolResult(text="Search failed: the search call needs a non-empty query.", error="malformed")
        return (await self.batch([query]))[0]

    async def batch(self, queries: list[str]) -> list[ToolResult]:
        """One ToolResult per query, in order: one request, or several at once where the queries exceed
        the server's limits (all the queries of a failed request fail alike)."""
        if not queries:
            return []
        if len(queries) == 1:  # one query is never split: `call` costs one request, as before
            return await self._request(queries)
        limits = await self.server_limits()
        results = await self._send_split(queries, limits)
        if any(r.error == "http_413" for r in results):  # the server's limits changed: read them again
            self._limits = None
            fresh = await self.server_limits()
            if fresh != limits:
                results = await self._send_split(queries, fresh)
        return results

    async def server_limits(self) -> dict[str, int]:
        """The request limits the server states in `GET /health` (read once, then kept); {} for a server
        that states none. Not kept when /health cannot be reached: the next batch asks again."""
        if self._limits is not None:
            return self._limits
        try:
            response = await self._client.get(health_url(self.url))
        except httpx.HTTPError:
            return {}
        limits = {}
        if response.status_code == 200:
            try:
                stated = response.json().get("limits")
            except (ValueError, AttributeError):
                stated = None
            if isinstance(stated, dict):
                limits = {k: v for k, v in stated.items() if isinstance(v, int) and v > 0}
        self._limits = limits
        return limits

    async def _send_split(self, queries: list[str], limits: dict[str, int]) -> list[ToolResult]:
        chunks = split_queries(queries, self.topk, limits)
        if len(chunks) == 1:
            return await self._request(queries)
        parts = await asyncio.gather(*(self._request(chunk) for chunk in chunks))
        return [result for part in parts for result in part]

    async def _request(self, queries: list[str]) -> list[ToolResult]:
        """One request for all `queries`; one ToolResult each (all failed alike if the request fails)."""
        started = time.monotonic()
        payload = {"queries": queries, "topk": self.topk, "return_scores": True}
        error, detail, attempts, body = None, "", 0, None
        for attempt in range(self.max_retries + 1):
            attempts = attempt + 1
            error, detail, body, retry = await self._post(payload)
            if error is None or not retry or attempt == self.max_retries:
                break
            await asyncio.sleep(self.backoff_s * 2**attempt)
        latency = time.monotonic() - started
        meta = {"attempts": attempts}
        if error is None:
            try:
                results = body["result"]
                if not isinstance(results, list) or len(results) != len(queries):
                    raise ValueError(f"expected {len(queries)} result lists")
                parsed = [_documents(items) for items in results]
            except (KeyError, TypeError, ValueError) as e:
                error, detail = "bad_response", f"the search service answered in an unexpected shape ({e})"
            else:
                return [
                    ToolResult(
                        text=format_passages(docs) if docs else "No results.",
                        latency_s=latency,
                        metadata={**meta, "documents": docs, "scores": scores},
                    )
                    for docs, scores in parsed
                ]
        tries = f" (after {attempts} attempts)" if attempts > 1 else ""
        text = f"Search failed: {detail}{tries}."
        return [ToolResult(text=text, error=error, latency_s=latency, metadata=meta) for _ in queries]

    async def _post(self, payload: dict[str, Any]) -> tuple[str | None, str, Any, bool]:
        """(error kind or None, explanation, parsed body, whether a retry may help)."""
        try:
            response = await self._client.post(self.url, json=payload)
        except httpx.TimeoutException:
            return "no_answer", f"the search service did not answer within {self.timeout_s:g}s", None, True
        except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as e:
            return "connection", f"cannot reach the search service at {self.url} ({type(e).__name__})", None, True
        except httpx.HTTPError as e:  # any other transport failure (a protocol or decoding error): not retried
            return "connection", f"the request to the search service at {self.url} failed ({type(e).__name__}: {e})", None, False
        if response.status_code >= 400:
            kind = f"http_{response.status_code}"
            detail = f"the search service answered HTTP {response.status_code}: {response.text[:200]}"
            return kind, detail, None, response.status_code >= 500 or response.status_code == 429
        try:
            return None, "", response.json(), False
        except ValueError:
            return "bad_response", "the search service answered with invalid JSON", None, False
