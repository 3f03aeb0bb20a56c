"""`agentrl retriever build|serve` (also `python -m retriever`): the command line of the retrieval service.

Heavy modules (torch, transformers, faiss, bm25s, uvicorn) are imported inside the commands, so `--help`
is instant. Every user-facing problem arrives as a RetrieverError (errors.py) and leaves as one line,
`error: ...`, with exit code 2. `build` runs build.py (or reindex.py with --from-index); `serve` opens the
index with searcher.py, then runs server.py's app under uvicorn.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from retriever.corpus import DEFAULT_MAX_PASSAGE_CHARS
from retriever.encoder import DEFAULT_ENCODER
from retriever.server_settings import ServerSettings

app = typer.Typer(
    help="Build and serve retrieval indexes (dense FAISS or BM25) with Search-R1's /retrieve schema.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

Opt = typer.Option
_SERVE = ServerSettings()  # `serve`'s defaults are the settings' own
OptInt = Optional[int]  # noqa: UP045 - typer reads annotations at runtime on Python 3.10
OptStr = Optional[str]  # noqa: UP045
PRECISION_HELP = ("Encoder compute dtype: auto (fp16 on GPU, bf16 on CPUs with AMX / AVX512-BF16, else fp32) | "
                  "float32 | bfloat16 | float16.")
OptPath = Optional[Path]  # noqa: UP045
INDEX_PARAMS = ("hnsw_m", "ef_construction", "ef_search", "nlist", "pq_m", "pq_nbits", "nprobe", "train_size")


def _fail(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code=2)


@app.command()
def build(
    out: Annotated[Path, Opt(help="The index directory to create (it appears only when complete).")],
    corpus: Annotated[OptPath, Opt(help='JSONL corpus, one {"id", "contents": "\\"Title\\"\\ntext"} a line.')] = None,
    index: Annotated[str, Opt(help="flat | hnsw | ivfpq | bm25")] = "flat",
    encoder: Annotated[str, Opt(help="Hub id (from the local cache) or model directory.")] = DEFAULT_ENCODER,
    from_index: Annotated[OptPath, Opt(help="Reuse the vectors of a built dense index instead of a corpus.")] = None,
    pooling: Annotated[OptStr, Opt(help="mean | cls (default: from the encoder's name / layout).")] = None,
    prefix_style: Annotated[str, Opt(help="auto | e5 | bge | none: query/passage prefixes.")] = "auto",
    query_prefix: Annotated[OptStr, Opt(help="Explicit query prefix (overrides --prefix-style).")] = None,
    passage_prefix: Annotated[OptStr, Opt(help="Explicit passage prefix (overrides --prefix-style).")] = None,
    max_length: Annotated[int, Opt(help="Max tokens per passage and query.")] = 256,
    batch_size: Annotated[OptInt, Opt(help="Encoder batch size (default 64 on CPU, 256 per GPU).")] = None,
    device: Annotated[OptStr, Opt(help="cpu | cuda | cuda:N (default: cuda when available).")] = None,
    precision: Annotated[str, Opt(help=PRECISION_HELP)] = "auto",
    shard_size: Annotated[int, Opt(help="Passages per committed shard (the unit of resume).")] = 16384,
    skip_bad: Annotated[bool, Opt(help="Skip and count bad corpus lines instead of stopping.")] = False,
    max_passage_chars: Annotated[int, Opt(help="Cut each string field of a row to this many characters "
                                          "(counted in the manifest).")] = DEFAULT_MAX_PASSAGE_CHARS,
    restart: Annotated[bool, Opt(help="Discard an interrupted build instead of resuming it.")] = False,
    overwrite: Annotated[bool, Opt(help="Replace --out if it exists and is an index directory (a manifest and "
                                        "the files a build writes; anything else is refused).")] = False,
    keep_embeddings: Annotated[bool, Opt(help="Keep the embedding shards in OUT/embeddings.")] = False,
    gpu: Annotated[bool, Opt(help="Use faiss-gpu when GPUs are present.")] = True,
    threads: Annotated[OptInt, Opt(help="CPU threads for torch and faiss (default: all cores).")] = None,
    hnsw_m: Annotated[OptInt, Opt(help="HNSW neighbours per node (32).")] = None,
    ef_construction: Annotated[OptInt, Opt(help="HNSW build beam (200).")] = None,
    ef_search: Annotated[OptInt, Opt(help="HNSW search beam (128).")] = None,
    nlist: Annotated[OptInt, Opt(help="IVF lists (~4 sqrt(N)).")] = None,
    pq_m: Annotated[OptInt, Opt(help="PQ sub-quantizers; must divide the dimension (dim/4).")] = None,
    pq_nbits: Annotated[OptInt, Opt(help="Bits per PQ code (8).")] = None,
    nprobe: Annotated[OptInt, Opt(help="IVF lists probed per query (nlist/16, at least 8).")] = None,
    train_size: Annotated[OptInt, Opt(help="IVF training sample size.")] = None,
    k1: Annotated[float, Opt(help="BM25 k1.")] = 0.9,
    b: Annotated[float, Opt(help="BM25 b.")] = 0.4,
    quiet: Annotated[bool, Opt(help="No progress bar or messages.")] = False,
) -> None:
    """Build an index directory from a corpus (streaming, resumable, atomic)."""
    options = dict(locals())  # every option above, by name: nothing else is bound yet
    from retriever.errors import RetrieverError

    try:
        _build(**options)
    except RetrieverError as e:
        raise _fail(str(e)) from None


def _build(out: Path, corpus: Path | None, from_index: Path | None, index: str, gpu: bool, overwrite: bool,
           threads: int | None, quiet: bool, **knobs: Any) -> None:
    """`build`'s work: reindex.py over --from-index's vectors, else build.py over --corpus. Of the other
    options (`knobs`), INDEX_PARAMS are the index's parameters and the rest BuildConfig's fields."""
    from retriever.errors import RetrieverError

    params = {name: knobs.pop(name) for name in INDEX_PARAMS}
    if from_index is not None:
        from retriever.reindex import reindex

        if corpus is not None:
            raise RetrieverError("give --corpus or --from-index, not both")
        manifest = reindex(from_index, out, index, params, use_gpu=gpu, overwrite=overwrite, threads=threads)
        if not quiet:
            typer.echo(f"wrote {out}: {manifest.index_type} over the vectors of {from_index}", err=True)
        return
    if corpus is None:
        raise RetrieverError("--corpus is required (or --from-index DIR)")
    from retriever.build import build as run_build
    from retriever.build_config import BuildConfig

    run_build(BuildConfig(corpus=corpus, out=out, index_type=index, overwrite=overwrite, use_gpu=gpu,
                          threads=threads, index_params=params, progress=not quiet, **knobs))


@app.command()
def serve(
    index: Annotated[Path, Opt(help="An index directory made by `build`.")],
    host: Annotated[str, Opt(help="Interface to listen on (0.0.0.0 for other machines).")] = "127.0.0.1",
    port: Annotated[int, Opt(help="TCP port.")] = 8000,
    encoder: Annotated[OptStr, Opt(help="Where the index's encoder lives on this machine, if moved.")] = None,
    device: Annotated[OptStr, Opt(help="Encoder device (default: cuda when available).")] = None,
    precision: Annotated[str, Opt(help=PRECISION_HELP)] = "auto",
    gpu: Annotated[bool, Opt(help="Search on faiss-gpu when GPUs are present.")] = True,
    mmap: Annotated[bool, Opt(help="Memory-map the FAISS index instead of reading it into RAM.")] = False,
    threads: Annotated[OptInt, Opt(help="CPU threads for torch and faiss (default: all cores).")] = None,
    topk: Annotated[int, Opt(help="topk when a request gives none (or 0).")] = _SERVE.default_topk,
    dynamic_batching: Annotated[bool, Opt(help="Merge concurrent requests into one forward + search.")] = _SERVE.dynamic_batching,
    max_batch_queries: Annotated[int, Opt(help="Most queries merged into one batch.")] = _SERVE.max_batch_queries,
    max_wait_ms: Annotated[float, Opt(help="How long a batch waits for more requests.")] = _SERVE.max_wait_ms,
    max_queries: Annotated[int, Opt(help="Most queries in one request (413 beyond).")] = _SERVE.max_queries,
    max_results: Annotated[int, Opt(help="Most queries x topk in one request (413 beyond).")] = _SERVE.max_results,
    max_query_chars: Annotated[int, Opt(help="Longest query in characters (422 beyond).")] = _SERVE.max_query_chars,
    max_body_bytes: Annotated[int, Opt(help="Largest request body (413 beyond).")] = _SERVE.max_body_bytes,
    log_level: Annotated[str, Opt(help="uvicorn log level.")] = "warning",
) -> None:
    """Serve an index: POST /retrieve (Search-R1 schema), GET /health."""
    from retriever.errors import RetrieverError
    from retriever.searcher import open_index

    try:
        opened = open_index(index, encoder=encoder, device=device, precision=precision, use_gpu=gpu, mmap=mmap,
                            threads=threads)
    except RetrieverError as e:
        raise _fail(str(e)) from None
    import sys

    import uvicorn

    from retriever.server import create_app

    # The encoder forward runs on a worker thread and holds the GIL between torch kernels; a 1 ms switch
    # interval (Python's default is 5 ms) lets the event loop accept the requests that form the next batch.
    sys.setswitchinterval(0.001)

    settings = ServerSettings(
        default_topk=topk, max_queries=max_queries, max_results=max_results, max_query_chars=max_query_chars,
        max_body_bytes=max_body_bytes,
        dynamic_batching=dynamic_batching, max_batch_queries=max_batch_queries, max_wait_ms=max_wait_ms,
    )  # fmt: skip
    m = opened.manifest
    typer.echo(
        f"serving {index}: {m.index_type}, {m.corpus.rows} passages, encoder {opened.encoder_name}, "
        f"on http://{host}:{port}/retrieve",
        err=True,
    )
    uvicorn.run(create_app(opened, settings), host=host, port=port, log_level=log_level, access_log=False)
