"""`python -m sandbox serve ...`: the same command line as `agentrl sandbox` (cli.py)."""

from sandbox.cli import app

if __name__ == "__main__":
    app(prog_name="python -m sandbox")
