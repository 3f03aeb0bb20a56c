"""The HTTP service: `POST /retrieve` with Search-R1's schema and `GET /health`.

Request `{"queries": [...], "topk": k, "return_scores": bool}`. Response `{"result": [...]}`, one list per
query, best first: `{"document": {"id", "contents", ...}, "score"}` items with `return_scores` (the
document is the corpus row, every field of it), the bare documents without (what Search-R1's server
meant to return; its own fails on `return_scores=false`).
`topk` missing, null or 0 means the server's default (3, Search-R1's training setting), as Search-R1's
server reads it. Bad input is answered at the boundary: a body over the size limit or too many queries ->
413; a negative `topk` or one over 1000, an over-long query or a malformed body -> 422; no queries -> an
empty result. `GET /health` states the limits, so a client can split its requests to fit
(agentrl/tools/search.py does). Requests go through batching.py; the index was opened and checked
by searcher.py before the app exists. cli.py runs it under uvicorn.
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from retriever.batching import DynamicBatcher
from retriever.searcher import OpenIndex
from retriever.server_settings import ServerSettings

INLINE_RESULTS = 1024  # answers of up to this many documents are serialised on the event loop


class RetrieveRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")  # Search-R1 clients may send more; these three are the schema

    queries: list[str]
    topk: int | None = None
    return_scores: bool = False


def _unprocessable(detail: object) -> JSONResponse:
    return JSONResponse(status_code=422, content={"detail": detail})


async def _read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed `limit` (declared or streamed)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise HTTPException(413, f"request body of {declared} bytes exceeds the limit of {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HTTPException(413, f"request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects: with the body read, the next ASGI message is the disconnect.
    uvicorn does not cancel a handler whose client left, so /retrieve watches for it itself."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(opened: OpenIndex, settings: ServerSettings = ServerSettings()) -> FastAPI:  # noqa: B008
    batcher = DynamicBatcher(
        opened.index.search, opened.docs.get_many, max_batch_queries=settings.max_batch_queries,
        max_wait_ms=settings.max_wait_ms, merge=settings.dynamic_batching,
    )  # fmt: skip

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        await batcher.start()
        yield
        await batcher.stop()

    app = FastAPI(title="agentrl retriever", lifespan=lifespan)
    limits = settings.limits()
    app.state.batcher = batcher

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", **opened.describe(), "limits": limits, "batching": batcher.describe()}

    @app.post("/retrieve")
    async def retrieve(request: Request) -> JSONResponse:
        body = await _read_body(request, settings.max_body_bytes)
        try:
            req = RetrieveRequest.model_validate_json(body)
        except ValidationError as e:
            return _unprocessable(e.errors(include_url=False, include_context=False, include_input=False))
        topk = req.topk or settings.default_topk  # null and 0 mean the default, as in Search-R1's server
        if not 1 <= topk <= settings.max_topk:
            return _unprocessable(f"topk must be between 1 and {settings.max_topk} (0 or null: the default), got {topk}")
        if len(req.queries) > settings.max_queries:
            raise HTTPException(413, f"{len(req.queries)} queries in one request; the limit is {settings.max_queries}")
        if len(req.queries) * topk > settings.max_results:
            raise HTTPException(413, f"{len(req.queries)} queries x topk {topk} = {len(req.queries) * topk} results in "
                                     f"one request; the limit is {settings.max_results}: split the request")
        too_long = [i for i, q in enumerate(req.queries) if len(q) > settings.max_query_chars]
        if too_long:
            return _unprocessable(f"queries {too_long[:10]} exceed {settings.max_query_chars} characters")
        search = asyncio.ensure_future(batcher.retrieve(req.queries, topk))
        gone = asyncio.ensure_future(_client_gone(request))
        await asyncio.wait({search, gone}, return_when=asyncio.FIRST_COMPLETED)
        gone.cancel()
        if not search.done():  # the client left (a timeout): its queries leave the queue unsearched
            search.cancel()
            return JSONResponse(status_code=499, content={"detail": "the client went away"})
        try:
            hits = search.result()
        except Exception as e:  # noqa: BLE001 - reported to the client; the server keeps serving
            return JSONResponse(status_code=500, content={"detail": f"retrieval failed: {type(e).__name__}: {e}"})
        if req.return_scores:
            result = [[{"document": doc, "score": score} for doc, score in query] for query in hits]
        else:
            result = [[doc for doc, _ in query] for query in hits]
        if len(req.queries) * topk <= INLINE_RESULTS:  # the usual answer: serialising it costs less than a thread hop
            return JSONResponse({"result": result})
        # a large one is serialised (in JSONResponse's constructor) on a thread: it must not hold up other clients
        return await asyncio.to_thread(JSONResponse, {"result": result})

    return app
