"""`agentrl view RUN_DIR [RUN_DIR ...]`: a local web page over runs, served by FastAPI (page.html, no build).

    GET /                                   the page
    GET /api/runs                           the runs: name, kind (train or eval), steps with headline metrics
    GET /api/runs/{run}/metrics             every metrics line (the curves tab)
    GET /api/runs/{run}/steps/{step}        the step's samples, summarised, filtered by the query: min_score,
                                            max_score, stop, tool (called / none), tool_error, stale, q (text)
    GET /api/runs/{run}/steps/{step}/{i}    one sample whole (segments with their per-token arrays)
    GET /api/runs/{run}/prompts/{prompt}    the same prompt's samples in every step

The page asks for a step's summaries first and a trajectory when one is opened (data.py), so a run of many
large steps stays quick. It binds to 127.0.0.1 by default: on a remote machine, forward the port over SSH.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agentrl.view.data import Run, open_runs

PAGE = Path(__file__).with_name("page.html")


def app_for(paths: list[Path], hosts: tuple[str, ...] = ("127.0.0.1", "localhost")) -> Any:
    """The viewer's app over the runs at `paths`, answering requests addressed to one of `hosts` only (a web
    page elsewhere cannot reach it by pointing a name of its own at this machine)."""
    from fastapi import FastAPI, HTTPException
    from fastapi.responses import HTMLResponse
    from starlette.middleware.trustedhost import TrustedHostMiddleware

    runs = {r.name: r for r in open_runs(paths)}
    app = FastAPI(title="agentrl view")
    app.add_middleware(TrustedHostMiddleware, allowed_hosts=list(hosts))

    def run_of(name: str) -> Run:
        if name not in runs:
            raise HTTPException(404, f"no run {name!r}; runs: {', '.join(runs)}")
        return runs[name]

    def found(fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except KeyError as e:
            raise HTTPException(404, str(e.args[0])) from None

    @app.get("/", response_class=HTMLResponse)
    def page() -> str:
        return PAGE.read_text()

    @app.get("/api/runs")
    def list_runs() -> list[dict[str, Any]]:
        return [{"name": r.name, "kind": r.kind, "path": str(r.path), "steps": r.steps()} for r in runs.values()]

    @app.get("/api/runs/{run}/metrics")
    def metrics(run: str) -> list[dict[str, Any]]:
        return run_of(run).metrics()

    @app.get("/api/runs/{run}/steps/{step}")
    def step(run: str, step: str, min_score: float | None = None, max_score: float | None = None,
             stop: str | None = None, tool: str | None = None, tool_error: bool = False, stale: bool = False,
             q: str | None = None) -> dict[str, Any]:
        rows = found(run_of(run).index, step)
        kept = [r for r in rows if _keep(r, min_score, max_score, stop, tool, tool_error, stale, q)]
        return {"total": len(rows), "rows": [_light(r) for r in kept],
                "stops": sorted({r["stop_reason"] for r in rows if r["stop_reason"]})}

    @app.get("/api/runs/{run}/steps/{step}/{i}")
    def trajectory(run: str, step: str, i: int) -> dict[str, Any]:
        return _light(found(run_of(run).trajectory, step, i))

    @app.get("/api/runs/{run}/prompts/{prompt_id}")
    def prompt(run: str, prompt_id: str) -> list[dict[str, Any]]:
        return [_light(r) for r in run_of(run).prompt_across_steps(prompt_id)]

    return app


def _keep(r: dict[str, Any], min_score: float | None, max_score: float | None, stop: str | None, tool: str | None,
          tool_error: bool, stale: bool, q: str | None) -> bool:
    score = r["score"] if r["score"] is not None else float("nan")
    return ((min_score is None or score >= min_score) and (max_score is None or score <= max_score)
            and (not stop or r["stop_reason"] == stop)
            and (tool is None or tool == "" or (tool == "called") == (r["tool_calls"] > 0))
            and (not tool_error or r["tool_error"]) and (not stale or r["staleness"] > 0)
            and (not q or q.lower() in r["text"]))


def _light(row: dict[str, Any]) -> dict[str, Any]:
    """A summary without its search text (the page never needs it)."""
    return {k: v for k, v in row.items() if k != "text"}
