"""The viewer inside one HTML file (`agentrl report`): page.html with the data it would ask the server for
written into it (`window.AGENTRL_EMBED`), for the steps chosen, so a run can be shared as one file."""

from __future__ import annotations

import html
import json
from typing import Any

from agentrl.view.data import Run
from agentrl.view.server import PAGE


def embedded_data(runs: list[Run], steps: dict[str, list[str]], per_step: int) -> dict[str, Any]:
    """What the page asks for, answered ahead: each run's chosen `steps` (by run name) with the first
    `per_step` samples of each, their summaries and whole records, and the run's metrics."""
    data: dict[str, Any] = {}
    listing = []
    for run in runs:
        chosen = [s for s in run.steps() if s["step"] in steps.get(run.name, [])]
        listing.append({"name": run.name, "kind": run.kind, "path": str(run.path), "steps": chosen})
        data[run.name] = {"metrics": run.metrics(), "steps": {}}
        for s in chosen:
            rows = run.index(s["step"])[:per_step]
            data[run.name]["steps"][s["step"]] = {
                "rows": rows, "records": [run.trajectory(s["step"], r["i"])["record"] for r in rows]}
    return {"runs": listing, "data": data}


def embedded_page(runs: list[Run], steps: dict[str, list[str]], per_step: int) -> str:
    """page.html holding its data: a whole page, to put in an iframe's srcdoc."""
    data = embedded_data(runs, steps, per_step)
    # <, > and & as JSON escapes: no text of a trajectory can end or reopen the script element
    text = json.dumps(data).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    script = "<script>window.AGENTRL_EMBED = " + text + ";</script>"
    return PAGE.read_text().replace("<script>", script + "\n<script>", 1)


def iframe(runs: list[Run], steps: dict[str, list[str]], per_step: int) -> str:
    """An iframe showing the viewer over the chosen steps, its page inlined (srcdoc)."""
    page = embedded_page(runs, steps, per_step)
    return (f'<iframe class="viewer" title="trajectories" style="width:100%;height:900px;border:1px solid #ccc" '
            f'srcdoc="{html.escape(page, quote=True)}"></iframe>')
