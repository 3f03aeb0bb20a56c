"""The one exception type of the retrieval service: a problem already phrased for the user.

Raised at the boundary (a bad corpus line, a manifest that does not match the encoder, a missing model)
and printed by cli.py as `error: ...` with exit code 2; the server never starts on one.
"""

from __future__ import annotations


class RetrieverError(Exception):
    """A user-facing problem with a corpus, an encoder or an index directory."""
