"""`python -m retriever build|serve`: the same commands as `agentrl retriever` (cli.py)."""

from retriever.cli import app

if __name__ == "__main__":
    app()
