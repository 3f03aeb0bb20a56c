"""What `retriever serve` accepts in one request and how it batches: server.py enforces these, cli.py
takes its defaults from them, and `GET /health` states the request limits so that clients can split
their requests to fit. Kept apart from server.py so the command line reads them without importing the
web stack."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerSettings:
    default_topk: int = 3
    max_topk: int = 1000
    max_queries: int = 4096  # Search-R1's GRPO recipe sends 512 prompts x 5 samples = 2,560 in one request
    max_results: int = 65536  # queries x topk in one request: bounds the answer built for it
    max_query_chars: int = 4096
    max_body_bytes: int = 4 << 20
    dynamic_batching: bool = True
    max_batch_queries: int = 256
    max_wait_ms: float = 2.0

    def limits(self) -> dict[str, int]:
        """What one request may hold, as `/health` states it for clients that split their requests."""
        return {
            "default_topk": self.default_topk, "max_topk": self.max_topk, "max_queries": self.max_queries,
            "max_results": self.max_results, "max_query_chars": self.max_query_chars,
            "max_body_bytes": self.max_body_bytes,
        }  # fmt: skip
