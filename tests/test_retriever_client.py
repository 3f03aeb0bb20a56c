"""agentrl/tools/search.py over loopback HTTP: Search-R1's formatting against our server and against a
server that answers exactly as Search-R1's does; failures (5xx, timeout, refused connection, 4xx) become
ToolResults with `error` set after bounded retries, never exceptions."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from agentrl.tools import Tool
from agentrl.tools.code import CodeTool
from agentrl.tools.search import SearchTool, format_passages, retrieve_url, split_queries
from agentrl.types import ToolCall
from tests.test_retriever_support import build_index, free_port, serve_index, serving, write_jsonl

CORPUS = [
    {"id": "0", "contents": '"Paris"\nParis is the capital of France.'},
    {"id": "1", "contents": '"Berlin"\nBerlin is the capital of Germany.'},
    {"id": "2", "contents": '"Cheese"\nFrance makes many cheeses.\nSome are blue.'},
]


def _run(coro):
    return asyncio.run(coro)


async def _call(url: str, query: str, **kwargs):
    tool = SearchTool(url, **kwargs)
    try:
        return await tool.call(ToolCall("search", {"query": query}))
    finally:
        await tool.aclose()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("client")
    build_index(write_jsonl(root / "c.jsonl", CORPUS), root / "idx", "bm25")
    with serve_index(root / "idx") as url:
        yield url


def test_formats_like_search_r1(server):
    result = _run(_call(server, "capital of France", topk=2))
    assert result.ok and result.error is None
    assert result.text == "Doc 1(Title: \"Paris\") Paris is the capital of France.\nDoc 2(Title: \"Berlin\") Berlin is the capital of Germany."
    assert [d["id"] for d in result.metadata["documents"]] == ["0", "1"]
    assert result.metadata["attempts"] == 1


def test_batch_sends_one_request_for_many_queries(server):
    async def go():
        tool = SearchTool(server + "/", topk=1)  # a base URL works too
        try:
            return await tool.batch(["Germany", "blue cheeses", "zebra"])
        finally:
            await tool.aclose()

    germany, cheese, zebra = _run(go())
    assert germany.text == "Doc 1(Title: \"Berlin\") Berlin is the capital of Germany."
    assert cheese.text == "Doc 1(Title: \"Cheese\") France makes many cheeses.\nSome are blue."
    assert zebra.ok and zebra.text == "No results."


def test_batch_is_split_to_the_server_s_limits(tmp_path):
    """A server that takes 2 queries, or 3 results, a request: the tool reads that from /health and sends
    the batch in parts, whose results come back in the batch's order."""
    build_index(write_jsonl(tmp_path / "c.jsonl", CORPUS), tmp_path / "idx", "bm25")
    queries = ["Germany", "blue cheeses", "zebra", "capital of France", "Berlin"]

    async def go(url: str, topk: int):
        tool = SearchTool(url, topk=topk)
        try:
            return [await tool.call(ToolCall("search", {"query": q})) for q in queries], await tool.batch(queries)
        finally:
            await tool.aclose()

    for topk, requests in ((1, 3), (2, 5)):  # 2 queries a request at topk 1; at topk 2, 3 results hold 1 query
        with serve_index(tmp_path / "idx", max_queries=2, max_results=3) as url:
            alone, batched = _run(go(url, topk))
            served = httpx.get(f"{url}/health").json()["batching"]["requests"]
        assert all(r.ok for r in batched)
        assert [r.text for r in batched] == [r.text for r in alone]
        assert served == len(queries) + requests


def test_split_queries_fits_each_limit():
    queries = ["a" * 10, "b" * 10, "c" * 10, "d"]
    assert split_queries(queries, 3, {}) == [queries]
    assert split_queries(queries, 3, {"max_queries": 3}) == [queries[:3], queries[3:]]
    assert split_queries(queries, 3, {"max_results": 7}) == [queries[:2], queries[2:]]
    envelope = len('{"queries": [], "topk": 3, "return_scores": true}')
    assert split_queries(queries, 3, {"max_body_bytes": envelope + 2 * 14}) == [queries[:2], queries[2:]]
    assert split_queries(["x" * 100], 3, {"max_body_bytes": 10}) == [["x" * 100]]  # the server says why


def _limited_app(stated: dict, enforced: int) -> FastAPI:
    """States `stated` limits in /health but answers 413 beyond `enforced` queries, until a 413 has been
    sent: then it states the real limit (a server restarted with a smaller --max-queries)."""
    app = FastAPI()
    app.state.sizes = []

    @app.get("/health")
    async def health():
        return {"status": "ok", "limits": stated}

    @app.post("/retrieve")
    async def retrieve(request: Request):
        queries = (await request.json())["queries"]
        app.state.sizes.append(len(queries))
        if len(queries) > enforced:
            stated["max_queries"] = enforced
            return JSONResponse(status_code=413, content={"detail": f"the limit is {enforced}"})
        return {"result": [[{"document": {"id": q, "contents": f'"{q}"\ntext'}, "score": 1.0}] for q in queries]}

    return app


def test_limits_are_read_again_after_a_413():
    app = _limited_app({"max_queries": 10}, enforced=2)

    async def go(url: str):
        tool = SearchTool(url, topk=1)
        try:
            return await tool.batch(["q1", "q2", "q3", "q4", "q5"])
        finally:
            await tool.aclose()

    with serving(app) as url:
        results = _run(go(url))
    assert [r.text for r in results] == [f'Doc 1(Title: "q{i}") text' for i in range(1, 6)]
    assert app.state.sizes[0] == 5 and sorted(app.state.sizes[1:]) == [1, 2, 2]


def test_is_a_tool():
    tool = SearchTool()
    assert isinstance(tool, Tool) and tool.name == "search"
    _run(tool.aclose())


def test_malformed_call_needs_no_request():
    async def go():
        tool = SearchTool(f"http://127.0.0.1:{free_port()}")
        try:
            return await tool.call(ToolCall("search", {"q": "x"}))
        finally:
            await tool.aclose()

    result = _run(go())
    assert result.error == "malformed" and "query" in result.text


def test_format_passages_and_url():
    docs = [{"contents": '"A title"\nline one\nline two'}, {"contents": "no title line"}]
    assert format_passages(docs) == "Doc 1(Title: \"A title\") line one\nline two\nDoc 2(Title: no title line) "
    assert retrieve_url("http://h:8000") == "http://h:8000/retrieve"
    assert retrieve_url("http://h:8000/retrieve") == "http://h:8000/retrieve"


def _search_r1_app(fail_first: int = 0, status: int = 503) -> FastAPI:
    """Answers like Search-R1's retrieval_server.py (`return_scores=true`), after `fail_first` failures."""
    app = FastAPI()
    seen = {"requests": 0}
    app.state.seen = seen

    @app.get("/health")
    async def health():
        return {"ok": True}

    @app.post("/retrieve")
    async def retrieve(request: Request):
        seen["requests"] += 1
        if seen["requests"] <= fail_first:
            return JSONResponse(status_code=status, content={"detail": "busy"})
        body = await request.json()
        assert body["return_scores"] is True  # Search-R1's server fails without it
        result = [
            [{"document": {"id": str(i), "contents": CORPUS[i]["contents"]}, "score": 1.0 - i / 10} for i in range(body["topk"])]
            for _ in body["queries"]
        ]
        return {"result": result}

    return app


def test_works_against_a_search_r1_shaped_server():
    with serving(_search_r1_app()) as url:
        result = _run(_call(url, "anything", topk=2))
    assert result.text.startswith("Doc 1(Title: \"Paris\") Paris is the capital of France.\nDoc 2(Title: \"Berlin\")")
    assert result.metadata["scores"] == [1.0, 0.9]


def test_retries_5xx_then_succeeds():
    app = _search_r1_app(fail_first=2)
    with serving(app) as url:
        result = _run(_call(url, "x", topk=1, max_retries=2, backoff_s=0.01))
    assert result.ok and result.metadata["attempts"] == 3 and app.state.seen["requests"] == 3


def test_persistent_5xx_becomes_an_error_result():
    app = _search_r1_app(fail_first=100)
    with serving(app) as url:
        result = _run(_call(url, "x", max_retries=2, backoff_s=0.01))
    assert result.error == "http_503" and "HTTP 503" in result.text and "after 3 attempts" in result.text
    assert app.state.seen["requests"] == 3


def test_4xx_is_not_retried():
    app = _search_r1_app(fail_first=100, status=422)
    with serving(app) as url:
        result = _run(_call(url, "x", max_retries=3, backoff_s=0.01))
    assert result.error == "http_422" and app.state.seen["requests"] == 1


def test_timeout_becomes_an_error_result():
    app = FastAPI()
    never = asyncio.Event()

    @app.get("/health")
    async def health():
        return {"ok": True}

    @app.post("/retrieve")
    async def hang():
        try:
            await asyncio.wait_for(never.wait(), timeout=1)  # far past the client timeout; bounded for shutdown
        except TimeoutError:
            pass
        return {"result": [[]]}

    with serving(app) as url:
        result = _run(_call(url, "x", timeout_s=0.2, max_retries=1, backoff_s=0.01))
    assert result.error == "no_answer" and "0.2s" in result.text and result.metadata["attempts"] == 2


def test_refused_connection_becomes_an_error_result():
    result = _run(_call(f"http://127.0.0.1:{free_port()}", "x", max_retries=1, backoff_s=0.01))
    assert result.error == "connection" and "cannot reach" in result.text


@pytest.mark.parametrize("url", ["127.0.0.1:8000", "localhost:8000/retrieve", "http://127.0.0.1:80x0/retrieve",
                                 "http://[::1/retrieve", "ftp://127.0.0.1:8000"])
def test_an_unusable_url_is_refused_when_the_tool_is_made(url):
    """A URL no request can use is configuration, not a tool failure: named before any rollout starts."""
    with pytest.raises(ValueError, match="the retrieval service's URL"):
        SearchTool(url)
    with pytest.raises(ValueError, match="the sandbox's URL"):
        CodeTool(url)


def test_a_lent_client_stays_open():
    async def scenario():
        async with httpx.AsyncClient() as shared:
            first, second = SearchTool("http://127.0.0.1:1", client=shared), SearchTool("http://127.0.0.1:1", client=shared)
            await first.aclose()
            assert not shared.is_closed  # its owner closes it
            await second.aclose()
        owned = SearchTool("http://127.0.0.1:1")
        await owned.aclose()
        return owned._client.is_closed

    assert _run(scenario())


@pytest.mark.parametrize(("status", "body"), [(400, ["bad gateway"]), (400, "bad gateway"),
                                              (200, {"status": "Failed", "run_result": "oops"}), (200, [1, 2])])
def test_code_tool_reads_answers_of_any_shape(status, body):
    """A proxy or another sandbox may answer JSON that is not the expected object: a result, never a raise."""
    transport = httpx.MockTransport(lambda request: httpx.Response(status, json=body))

    async def scenario():
        async with httpx.AsyncClient(transport=transport) as client:
            tool = CodeTool("http://sandbox", client=client, max_retries=0)
            return await tool.call(ToolCall("python", {"code": "print(1)"}))

    result = _run(scenario())
    assert not result.ok and result.error in ("sandbox_error", "http_400"), result
