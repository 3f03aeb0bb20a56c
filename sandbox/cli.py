"""Command line of the sandbox service: `agentrl sandbox serve` (mounted by agentrl/cli.py) and
`python -m sandbox serve` (__main__.py). Builds `Settings` (settings.py) from flags and runs the app
(server.py) under uvicorn. Heavy imports happen inside the command so `agentrl --help` stays fast.
"""

from __future__ import annotations

import typer

app = typer.Typer(help="The code-execution sandbox service (SandboxFusion-compatible /run_code).",
                  no_args_is_help=True, add_completion=False)


@app.callback()
def _group() -> None:
    """Keeps `serve` a subcommand (Typer would otherwise make a lone command the whole app)."""


@app.command()
def serve(
    host: str = typer.Option("127.0.0.1", help="Address to bind; loopback by default."),
    port: int = typer.Option(8080, help="TCP port."),
    token: str | None = typer.Option(None, envvar="AGENTRL_SANDBOX_TOKEN",
                                     help="Require 'Authorization: Bearer TOKEN' (env AGENTRL_SANDBOX_TOKEN)."),
    backend: str = typer.Option("namespace", help="'namespace' (Linux namespaces) or 'docker'."),
    docker_image: str = typer.Option("python:3.11-slim", help="Image for the docker backend."),
    workers: int | None = typer.Option(None, help="Concurrent runs (pre-started workers); default 2 x CPUs."),
    max_queue: int = typer.Option(256, help="Runs allowed to wait for a worker before answering 503."),
    queue_timeout: float = typer.Option(60.0, help="Seconds a run may wait for a worker before answering 503."),
    max_run_timeout: float = typer.Option(120.0, help="Upper bound on run_timeout, seconds."),
    default_memory_mb: int = typer.Option(1024, help="Memory budget when a request gives none."),
    max_memory_mb: int = typer.Option(4096, help="Upper bound on memory_limit_MB."),
    max_processes: int = typer.Option(64, help="Processes per run (RLIMIT_NPROC, cgroup pids.max)."),
    disk_mb: int = typer.Option(256, help="Size of each run's tmpfs (/tmp, holding the working dir)."),
    max_output_bytes: int = typer.Option(1 << 20, help="Captured bytes per output stream."),
    max_code_bytes: int = typer.Option(1 << 20, help="Largest accepted `code` (413 beyond)."),
    max_fetch_bytes: int = typer.Option(16 << 20, help="Bytes of fetch_files returned per run, together."),
    max_sessions: int = typer.Option(32, help="Live sessions at most (0 disables sessions)."),
    session_idle: float = typer.Option(600.0, help="Seconds before an unused session is closed."),
    max_session_idle: float = typer.Option(3600.0, help="Upper bound on a session's own idle_timeout."),
    sessions_memory_mb: int = typer.Option(
        8192, help="Memory of all live sessions together: a session whose budget would take the open ones' "
                   "sum past it is refused (429)."),
    preload: str | None = typer.Option(
        None, help="Modules every worker imports before serving, comma-separated (default: math, numpy "
                   "and its random/linalg/fft, sympy, and a few stdlib modules)."),
    single_uid: bool = typer.Option(False, hidden=True,
                                    help="Use the non-root fallback (one uid, capabilities dropped) even as root."),
    log_level: str = typer.Option("info", help="uvicorn log level."),
) -> None:
    """Serve POST /run_code, GET /health and /sessions until interrupted."""
    import logging

    import uvicorn

    from sandbox.server import create_app
    from sandbox.settings import Settings

    extra: dict[str, object] = {"workers": workers} if workers else {}
    if preload is not None:
        extra["preload"] = tuple(m for m in preload.split(",") if m)
    settings = Settings(
        host=host, port=port, token=token, backend=backend, docker_image=docker_image, max_queue=max_queue,
        queue_timeout_s=queue_timeout, max_fetch_bytes=max_fetch_bytes,
        max_run_timeout_s=max_run_timeout, default_memory_mb=default_memory_mb, max_memory_mb=max_memory_mb,
        max_processes=max_processes, disk_mb=disk_mb, max_output_bytes=max_output_bytes,
        max_code_bytes=max_code_bytes, max_sessions=max_sessions, session_idle_s=session_idle,
        max_session_idle_s=max_session_idle, sessions_memory_mb=sessions_memory_mb,
        single_uid=single_uid, **extra,  # type: ignore[arg-type]
    )
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if host not in ("127.0.0.1", "::1", "localhost") and token is None:
        logging.getLogger("sandbox").warning(
            "binding %s without a token: anyone who can reach this port can run code here", host)
    uvicorn.run(create_app(settings), host=host, port=port, log_level=log_level, access_log=False)
