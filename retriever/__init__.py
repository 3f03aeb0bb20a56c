"""agentrl's retrieval service: build a dense (FAISS) or BM25 index over a Search-R1 / wiki-18 corpus, and
serve it over HTTP with Search-R1's `POST /retrieve` schema.

The flow, one module per step:
  corpus.py    stream `{"id", "contents"}` lines with line numbers; bad lines stop the build or are counted
  encoder.py   resolve an encoder (name or path, pooling, e5/bge prefixes); DenseEncoder (torch, imported lazily)
  ingest.py    corpus -> shards of embeddings or token ids, committed one by one (resumable), rows counted
  build.py     shards -> index -> manifest; atomic rename at the end
  outdir.py    the build's lock on its --out (one build at a time), and what --overwrite may replace
  faiss_index.py / bm25.py   the two index families behind one `search(queries, k)` shape
  analyzer.py  BM25's terms of a passage or query: Lucene's EnglishAnalyzer, as Search-R1's pyserini index
  ranking.py   best score first, ties in corpus order, the same whatever the batch
  docstore.py  every field of a row by integer row from an offsets file and a jsonl, without loading the corpus
  manifest.py  what an index directory holds; validated when a server opens it (searcher.py)
  batching.py  concurrent requests merged into one encoder forward and one index search
  server.py    the FastAPI app (server_settings.py: its limits); cli.py the `build` / `serve` commands
               (`agentrl retriever`, `python -m retriever`)

Importing this package imports neither torch nor transformers: a BM25 server never loads them.
The client that the trainer uses lives in agentrl/tools/search.py.
"""

from retriever.errors import RetrieverError

__all__ = ["RetrieverError"]
