"""Benchmark of the retrieval service (retriever/) on a synthetic wiki-18-format corpus, on this machine.

    python bench/bench_retriever.py                  # 100k passages (the reference run)
    python bench/bench_retriever.py --passages 5000  # a smoke run

Measures, in one run: build throughput (passages/s) with the embedded MiniLM (Flat) and with BM25; HNSW
built from the Flat vectors, its recall@10 against Flat and its search speedup (one query at a time, the
index alone); then each index served by two `python -m retriever serve` processes at once, one with
dynamic batching and one serving one request at a time (`--no-dynamic-batching`), driven over HTTP (a raw
keep-alive client, one query per request) at concurrency 1 and 16 in alternation for `--rounds` rounds:
median latency p50/p99 and QPS. The figure of merit is the QPS ratio at concurrency 16. Prints tables; `--json PATH` also writes the numbers. With `--workdir DIR`, a later run
reuses the corpus and indexes there (and the build figures measured when they were built).

Three other measurements, each on its own (they skip the above):

    python bench/bench_retriever.py --grpo --passages 5000   # Search-R1's GRPO batch: 2,560 queries at once
    python bench/bench_retriever.py --huge-line-mb 50        # a corpus with one 50 MB line: the size cap
    python bench/bench_retriever.py --analyzer               # BM25's Lucene analysis against a plain split

`--grpo` times one request of 2,560 queries (512 prompts x 5 samples) against each index, against the same
queries sent as one-query requests at concurrency 16, and the batch-invariant query encoder against
padding each batch to its longest query (the encoder alone). `--huge-line-mb` builds a small Flat index
whose corpus holds one huge line, with the default per-passage cap and without one (a cap past the
line's length), each build in its own process: wall time and peak memory. `--analyzer` times BM25's text
analysis (retriever/analyzer.py: Lucene's EnglishAnalyzer) on the synthetic passages and queries against
bm25s's own tokenizer with English stop words and no stemmer (what BM25 indexes used before), in
alternating rounds: terms per second, its first pass (every word stemmed once) and warm passes apart.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from retriever.build import build  # noqa: E402
from retriever.build_config import BuildConfig  # noqa: E402
from retriever.manifest import read_manifest  # noqa: E402
from retriever.reindex import reindex  # noqa: E402
from retriever.synthetic import SyntheticCorpus  # noqa: E402

K = 10
INDEXES = ("minilm-flat", "bm25")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_indexes(work: Path, n: int, threads: int | None, console: Console) -> dict:
    corpus = SyntheticCorpus(n)
    path = work / "corpus.jsonl"
    if not path.exists():
        corpus.write(path)
    out: dict = {"passages": n}
    for name, index_type in zip(INDEXES, ("flat", "bm25"), strict=True):
        if (work / name / "manifest.json").exists():  # --workdir of an earlier run: measured then
            manifest = read_manifest(work / name)
            wall = manifest.build["seconds_this_run"]
            if manifest.corpus.rows != n:
                raise SystemExit(f"{work / name} holds {manifest.corpus.rows} passages, not {n}: use another --workdir")
        else:
            console.print(f"building {name} over {n} passages ...")
            started = time.perf_counter()
            manifest = build(BuildConfig(corpus=path, out=work / name, index_type=index_type, threads=threads, progress=True))
            wall = time.perf_counter() - started
        out[name] = {
            "encode_passages_per_s": n / manifest.build["encode_seconds"],
            "end_to_end_passages_per_s": n / wall,
            "wall_s": wall,
        }
    if (work / "minilm-hnsw" / "manifest.json").exists():
        out["hnsw_build_s"] = read_manifest(work / "minilm-hnsw").build["index_seconds"]
    else:
        started = time.perf_counter()
        reindex(work / "minilm-flat", work / "minilm-hnsw", "hnsw", {}, threads=threads)
        out["hnsw_build_s"] = time.perf_counter() - started
    out["queries"] = corpus.queries(2000)
    return out


def hnsw_vs_flat(work: Path, queries: list[str], threads: int | None) -> dict:
    """Recall@10 of HNSW against Flat and the per-query search time of each, the indexes alone."""
    from retriever.searcher import open_index

    flat = open_index(work / "minilm-flat", threads=threads)
    hnsw = open_index(work / "minilm-hnsw", threads=threads)
    vectors = flat.index.encoder.encode(queries[:500], "query")
    result = {}
    for name, opened in (("flat", flat), ("hnsw", hnsw)):
        searcher = opened.index.faiss_search
        searcher.search(vectors[:10], K)  # warm-up
        started = time.perf_counter()
        rows = np.concatenate([searcher.search(v[None], K)[1] for v in vectors])
        result[name] = {"rows": rows, "ms_per_query": 1000 * (time.perf_counter() - started) / len(vectors)}
    exact, approx = result["flat"]["rows"], result["hnsw"]["rows"]
    recall = np.mean([len(set(a) & set(e)) / K for a, e in zip(approx, exact, strict=True)])
    return {
        "recall_at_10": float(recall),
        "flat_ms_per_query": result["flat"]["ms_per_query"],
        "hnsw_ms_per_query": result["hnsw"]["ms_per_query"],
        "speedup": result["flat"]["ms_per_query"] / result["hnsw"]["ms_per_query"],
    }


async def _post_raw(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes) -> bytes:
    """One HTTP/1.1 keep-alive round trip. A raw client: httpx would spend more CPU than the server's
    per-request work, on the same cores, and flatten the difference being measured."""
    writer.write(request)
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))
    body = await reader.readexactly(length)
    if status != 200:
        raise RuntimeError(f"HTTP {status}: {body[:200]!r}")
    return body


def _request(port: int, query: str) -> bytes:
    body = json.dumps({"queries": [query], "topk": 3, "return_scores": True}).encode()
    head = f"POST /retrieve HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


async def _load(port: int, queries: list[str], concurrency: int, requests: int) -> dict:
    latencies: list[float] = []
    encoded = [_request(port, q) for q in queries]

    async def worker(todo) -> None:
        connection = None
        for i in todo:
            started = time.perf_counter()
            for attempt in (0, 1):  # the server may close a keep-alive connection that sat idle: reconnect once
                if connection is None:
                    connection = await asyncio.open_connection("127.0.0.1", port)
                try:
                    json.loads(await _post_raw(*connection, encoded[i % len(encoded)]))
                    break
                except (asyncio.IncompleteReadError, ConnectionError):
                    connection[1].close()
                    connection = None
                    if attempt:
                        raise
            latencies.append(time.perf_counter() - started)
        if connection is not None:
            connection[1].close()

    await asyncio.gather(*(worker(range(2)) for _ in range(concurrency)))  # warm-up
    latencies.clear()
    todo = iter(range(requests))
    started = time.perf_counter()
    await asyncio.gather(*(worker(todo) for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    ms = np.array(latencies) * 1000
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)), "qps": len(ms) / elapsed}


@contextmanager
def server(index_dir: Path, batching: bool, threads: int | None) -> Iterator[int]:
    """`python -m retriever serve` in its own process; yields its port once /health answers."""
    port = _port()
    cmd = [sys.executable, "-m", "retriever", "serve", "--index", str(index_dir), "--port", str(port)]
    cmd += [] if batching else ["--no-dynamic-batching"]
    cmd += ["--threads", str(threads)] if threads else []
    log = index_dir.parent / f"serve-{index_dir.name}-{'dynamic' if batching else 'single'}.log"
    proc = subprocess.Popen(cmd, cwd=REPO, stderr=open(log, "w"))  # noqa: SIM115 - the child owns it
    try:
        deadline = time.monotonic() + 300
        while True:  # readiness: /health answers once the index and encoder are loaded
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}; see {log}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.1)
        yield port
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def measure_serving(index_dir: Path, queries: list[str], requests: int, rounds: int, threads: int | None) -> dict:
    """Both modes served at once and measured in alternation, `rounds` times; the median of each figure.
    Alternating keeps a burst of other load on a shared machine from landing on one mode only."""
    runs: dict[tuple[bool, int], list[dict]] = {(b, c): [] for b in (True, False) for c in (1, 16)}
    with server(index_dir, True, threads) as dynamic_port, server(index_dir, False, threads) as single_port:
        for round_ in range(rounds):
            for concurrency in (1, 16):
                n = requests if concurrency > 1 else max(50, requests // 4)
                modes = [(True, dynamic_port), (False, single_port)]
                for batching, port in modes if round_ % 2 == 0 else modes[::-1]:  # neither mode always first
                    runs[(batching, concurrency)].append(asyncio.run(_load(port, queries, concurrency, n)))
        health = httpx.get(f"http://127.0.0.1:{dynamic_port}/health").json()["batching"]
    result: dict = {key: {k: float(np.median([r[k] for r in rs])) for k in rs[0]} for key, rs in runs.items()}
    # the figure of merit: the median over rounds of each round's own ratio (both modes measured back to back)
    result["qps_ratio_c16"] = float(np.median([d["qps"] / s["qps"] for d, s in zip(runs[(True, 16)], runs[(False, 16)],
                                                                                   strict=True)]))
    result["dynamic_batches"] = f"{health['batches']} batches / {health['requests']} requests"
    return result


def grpo_request(work: Path, queries: list[str], threads: int | None, rounds: int, console: Console) -> None:
    """One request of 2,560 queries against each index, and the query encoder's two modes: each pair measured
    back to back, in alternating order, `rounds` times; the medians, and the median of the rounds' ratios."""
    from retriever.encoder import DenseEncoder
    from retriever.searcher import open_index

    grpo = (queries * (2560 // len(queries) + 1))[:2560]
    t = Table(title=f"Search-R1's GRPO batch: 2,560 queries, topk 3 (median of {rounds} rounds)")
    for col in ("index", "one request s", "2,560 one-query requests at c=16 s", "ratio"):
        t.add_column(col, justify="right")
    for name in INDEXES:
        with server(work / name, True, threads) as port:
            url = f"http://127.0.0.1:{port}/retrieve"
            httpx.post(url, json={"queries": grpo[:64], "topk": 3}, timeout=600)  # warm-up

            def one_request(url: str = url) -> float:
                started = time.perf_counter()
                response = httpx.post(url, json={"queries": grpo, "topk": 3, "return_scores": True}, timeout=600)
                assert response.status_code == 200 and len(response.json()["result"]) == len(grpo), response.text[:200]
                return time.perf_counter() - started

            def one_query_requests(port: int = port) -> float:
                return len(grpo) / asyncio.run(_load(port, grpo, 16, len(grpo)))["qps"]  # its warm-up excluded

            one, many = _alternate(one_request, one_query_requests, rounds)
        t.add_row(name, f"{np.median(one):.2f}", f"{np.median(many):.2f}", f"{np.median(np.divide(many, one)):.2f}x")
    console.print(t)
    spec = open_index(work / "minilm-flat", threads=threads).index.encoder.spec
    encoders = {invariant: DenseEncoder(spec, threads=threads, batch_invariant=invariant) for invariant in (False, True)}
    for encoder in encoders.values():
        encoder.encode(grpo[:64], "query")  # warm-up

    def timed(encoder) -> Callable[[], float]:
        def run() -> float:
            started = time.perf_counter()
            encoder.encode(grpo, "query")
            return time.perf_counter() - started

        return run

    padded, invariant = _alternate(timed(encoders[False]), timed(encoders[True]), rounds)
    t = Table(title=f"Query encoder alone, 2,560 queries (MiniLM, {encoders[True].precision}; median of {rounds} rounds)")
    for col in ("mode", "s", "queries/s"):
        t.add_column(col, justify="right")
    for mode, times in (("padded to each batch's longest", padded), ("batch-invariant (fixed shapes)", invariant)):
        t.add_row(mode, f"{np.median(times):.2f}", f"{len(grpo) / np.median(times):.0f}")
    console.print(t)
    console.print(f"batch-invariant / padded encoding time: {np.median(np.divide(invariant, padded)):.2f}x "
                  "(median of the rounds' own ratios)")


def _alternate(first: Callable[[], float], second: Callable[[], float], rounds: int) -> tuple[list[float], list[float]]:
    """`rounds` timings of each, measured back to back, neither always first."""
    a, b = [], []
    for round_ in range(rounds):
        for run, out in ((first, a), (second, b)) if round_ % 2 == 0 else ((second, b), (first, a)):
            out.append(run())
    return a, b


def huge_line(work: Path, megabytes: int, threads: int | None, console: Console) -> None:
    """Build a Flat index over 8 passages and one line of `megabytes` MB, with and without the size cap."""
    corpus = work / f"huge-{megabytes}mb.jsonl"
    if not corpus.exists():
        passages = list(SyntheticCorpus(8).passages())
        words = " ".join(SyntheticCorpus(8).queries(64, words=16)) + " "
        text = (words * ((megabytes << 20) // len(words) + 1))[: megabytes << 20]
        passages.insert(4, {"id": "huge", "contents": f'"Huge"\n{text}'})
        corpus.write_text("".join(json.dumps(p) + "\n" for p in passages))
    t = Table(title=f"Building a corpus of 9 lines, one of {megabytes} MB (Flat, MiniLM)")
    for col in ("per-passage cap", "wall s", "peak RSS MB"):
        t.add_column(col, justify="right")
    figures = {}
    for cap in ("16384", str(10**12)):
        out = work / f"huge-idx-{cap}"
        cmd = [sys.executable, "-m", "retriever", "build", "--corpus", str(corpus), "--out", str(out), "--overwrite",
               "--quiet", "--max-passage-chars", cap] + (["--threads", str(threads)] if threads else [])
        started = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=REPO)
        _, status, usage = os.wait4(proc.pid, 0)
        figures[cap] = (time.perf_counter() - started, usage.ru_maxrss / 1024)
        if status:
            raise SystemExit(f"build failed: {cmd}")
        t.add_row("none" if cap != "16384" else "16384 characters (default)", f"{figures[cap][0]:.1f}",
                  f"{figures[cap][1]:.0f}")
    console.print(t)
    (capped_s, capped_mb), (whole_s, whole_mb) = figures.values()
    console.print(f"without the cap / with it: {whole_s / capped_s:.1f}x the time, {whole_mb / capped_mb:.1f}x the memory")


def analyzer_cost(n: int, rounds: int, console: Console) -> None:
    import bm25s

    from retriever.analyzer import analyze

    corpus = SyntheticCorpus(n)
    texts = [p["contents"] for p in corpus.passages()] + corpus.queries(2000)

    def lucene() -> float:
        started = time.perf_counter()
        terms = sum(len(analyze(t)) for t in texts)
        return terms / (time.perf_counter() - started)

    def plain() -> float:  # bm25s's tokenizer as BM25 indexes used it before: lowercase, its split, stop words
        started = time.perf_counter()
        ids = bm25s.tokenize(texts, stopwords="en", show_progress=False, return_ids=True)
        return sum(len(d) for d in ids.ids) / (time.perf_counter() - started)

    first = lucene()  # a cold cache: every new word is analysed and stemmed once
    ours, base = _alternate(lucene, plain, rounds)
    t = Table(title=f"BM25 text analysis, {len(texts)} texts ({n} passages + 2,000 queries), terms/s")
    for col in ("analysis", "first pass", f"warm (median of {rounds})", "vs bm25s's split"):
        t.add_column(col, justify="right")
    t.add_row("Lucene English (analyzer.py)", f"{first:,.0f}", f"{statistics.median(ours):,.0f}",
              f"{statistics.median(ours) / statistics.median(base):.2f}x")
    t.add_row("bm25s, stop words, no stemmer", "", f"{statistics.median(base):,.0f}", "1.00x")
    console.print(t)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--passages", type=int, default=100_000)
    parser.add_argument("--requests", type=int, default=800, help="requests per (index, batching) at concurrency 16")
    parser.add_argument("--rounds", type=int, default=3, help="alternating measurement rounds (median)")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch and faiss (default: all)")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the corpus and indexes here (reused)")
    parser.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    parser.add_argument("--grpo", action="store_true", help="only time 2,560 queries in one request (see above)")
    parser.add_argument("--huge-line-mb", type=int, default=0, help="only time builds with a line this large")
    parser.add_argument("--analyzer", action="store_true", help="only time BM25's text analysis (see above)")
    args = parser.parse_args()
    console = Console(highlight=False)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-retriever-"))
    work.mkdir(parents=True, exist_ok=True)
    cpus = os.cpu_count()
    if args.huge_line_mb:
        return huge_line(work, args.huge_line_mb, args.threads, console)
    if args.analyzer:
        return analyzer_cost(args.passages, args.rounds, console)
    built = build_indexes(work, args.passages, args.threads, console)
    queries = built.pop("queries")
    if args.grpo:
        return grpo_request(work, queries, args.threads, args.rounds, console)
    ann = hnsw_vs_flat(work, queries, args.threads)
    serving = {name: measure_serving(work / name, queries, args.requests, args.rounds, args.threads) for name in INDEXES}

    title = f"{args.passages} synthetic passages, {cpus} CPUs, threads={args.threads or 'all'}"
    t = Table(title=f"Build throughput ({title})")
    for col in ("index", "encode passages/s", "end-to-end passages/s", "wall s"):
        t.add_column(col, justify="right")
    for name in INDEXES:
        b = built[name]
        t.add_row(name, f"{b['encode_passages_per_s']:.1f}", f"{b['end_to_end_passages_per_s']:.1f}", f"{b['wall_s']:.1f}")
    console.print(t)
    t = Table(title="HNSW (M=32, efSearch=128) vs Flat, MiniLM vectors, one query at a time")
    for col in ("recall@10", "flat ms/query", "hnsw ms/query", "speedup", "hnsw build s"):
        t.add_column(col, justify="right")
    t.add_row(f"{ann['recall_at_10']:.4f}", f"{ann['flat_ms_per_query']:.3f}", f"{ann['hnsw_ms_per_query']:.3f}",
              f"{ann['speedup']:.1f}x", f"{built['hnsw_build_s']:.1f}")  # fmt: skip
    console.print(t)
    t = Table(title=f"Serving over HTTP, one query per request, topk=3 (median of {args.rounds} rounds)")
    for col in ("index", "batching", "concurrency", "p50 ms", "p99 ms", "QPS"):
        t.add_column(col, justify="right")
    for name, r in serving.items():
        for c in (1, 16):
            for batching in (True, False):
                m = r[(batching, c)]
                mode = "dynamic" if batching else "one at a time"
                t.add_row(name, mode, str(c), f"{m['p50_ms']:.1f}", f"{m['p99_ms']:.1f}", f"{m['qps']:.1f}")
    console.print(t)
    ratios = {name: r["qps_ratio_c16"] for name, r in serving.items()}
    for name, ratio in ratios.items():
        console.print(f"{name}: QPS at concurrency 16, dynamic / one at a time = {ratio:.2f}x (median of the rounds' "
                      f"own ratios; {serving[name]['dynamic_batches']})")
    if args.json:
        flat = {name: {f"{'dynamic' if k[0] else 'single'}_c{k[1]}" if isinstance(k, tuple) else k: v
                       for k, v in r.items()} for name, r in serving.items()}  # fmt: skip
        summary = {"build": built, "hnsw_vs_flat": ann, "qps_ratio_c16": ratios, "serving": flat}
        args.json.write_text(json.dumps(summary, indent=2))
    console.print(f"(corpus and indexes in {work})")


if __name__ == "__main__":
    main()
