"""The run report (`agentrl report RUN_DIR [RUN_DIR ...]`): PNG plots and one self-contained HTML page.

It reads what a run dir already holds: `metrics.jsonl` (one line per step) and `samples/step_N.jsonl`.
Each panel plots some metrics against the step, every run overlaid in its own colour (a LIMR run against
its RAND baseline and the full set, say); a metric no run logged is left out, and a panel with none of
its metrics is skipped. The timing panel stacks the step's parts (rollout, logprobs, train, weight push,
...) of each run. The page embeds the PNGs and the trajectory viewer (agentrl/view/embed.py) over the
samples of a few steps spread over each run, so the report is one file to share. Files are written whole, then renamed.
"""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path
from typing import Any

from agentrl.config import ConfigError, atomic_write_text, read_jsonl
from agentrl.view.data import open_runs
from agentrl.view.embed import iframe

# (file name, title, [(metric, label)], y-axis label)
PANELS: list[tuple[str, str, list[tuple[str, str]], str]] = [
    ("reward", "Reward and validation score",
     [("reward/mean", "train reward"), ("reward/correct", "train correct"), ("val/score", "val score"),
      ("val/pass@1", "val pass@1")], "score"),
    ("length", "Response length", [("rollout/response_length/mean", "mean"),
                                   ("rollout/response_length/max", "max")], "tokens"),
    ("tools", "Turns and tool calls", [("rollout/turns/mean", "turns"),
                                       ("tool/calls_per_trajectory", "tool calls per trajectory")], "per trajectory"),
    ("tool_errors", "Tool error rate", [("tool/error_rate", "error rate")], "fraction"),
    ("tool_latency", "Tool latency", [("tool/latency_ms/p50", "p50"), ("tool/latency_ms/p99", "p99")], "ms"),
    ("loss", "Policy loss", [("actor/pg_loss", "pg loss"), ("actor/loss", "total loss")], "loss"),
    ("kl", "KL to the behaviour policy and engine-vs-learner gap",
     [("actor/approx_kl", "approx KL"), ("actor/engine_kl", "engine KL"), ("actor/kl", "KL to reference"),
      ("actor/logprob_gap", "logprob gap, mean |.|")], "nats"),
    ("entropy", "Entropy", [("actor/entropy", "entropy")], "nats / token"),
    ("clip", "Clipped fraction", [("actor/clip_frac", "clip fraction")], "fraction"),
    ("grad_norm", "Gradient norm", [("actor/grad_norm", "grad norm")], "norm"),
]
TIMING_SKIP = {"timing/step"}


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The run's metrics lines (its samples are the embedded viewer's to read, for the steps it shows)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(f"{run_dir}: no metrics.jsonl (is it a run dir of agentrl train?)")
    metrics = read_jsonl(path)
    if not metrics:
        raise ConfigError(f"{path}: no steps logged yet")
    return metrics


def _series(metrics: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    points = [(m["step"], m[key]) for m in metrics if isinstance(m.get(key), (int, float)) and m[key] == m[key]]
    return [p[0] for p in points], [p[1] for p in points]


def _png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return buf.getvalue()


def plots(runs: dict[str, list[dict[str, Any]]]) -> dict[str, tuple[str, bytes]]:
    """`{file name: (title, PNG bytes)}` for every panel some run has a metric of."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out: dict[str, tuple[str, bytes]] = {}
    styles = ["-", "--", ":", "-."]
    for name, title, keys, ylabel in PANELS:
        drawn = [(run, key, label) for key, label in keys for run, m in runs.items() if _series(m, key)[0]]
        if not drawn:
            continue
        fig, ax = plt.subplots(figsize=(6.4, 3.6))
        colours = {run: f"C{i}" for i, run in enumerate(runs)}
        for run, key, label in drawn:
            x, y = _series(runs[run], key)
            style = styles[[k for k, _ in keys].index(key) % len(styles)]
            ax.plot(x, y, style, color=colours[run], marker="." if len(x) < 30 else None,
                    label=f"{run}: {label}" if len(runs) > 1 else label)
        ax.set(title=title, xlabel="step", ylabel=ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        out[name] = (title, _png(fig))
        plt.close(fig)
    for run, m in runs.items():
        keys = sorted({k for line in m for k in line if k.startswith("timing/") and k not in TIMING_SKIP})
        if not keys:
            continue
        fig, ax = plt.subplots(figsize=(6.4, 3.6))
        steps = [line["step"] for line in m]
        ax.stackplot(steps, [[float(line.get(k, 0.0) or 0.0) for line in m] for k in keys],
                     labels=[k.removeprefix("timing/") for k in keys])
        ax.set(title=f"Step time by part: {run}", xlabel="step", ylabel="seconds")
        ax.legend(fontsize=7, loc="upper left")
        ax.grid(alpha=0.3)
        out[f"timing_{_slug(run)}"] = (f"Step time by part: {run}", _png(fig))
        plt.close(fig)
    return out


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in text)


def _picked_steps(steps: list[int], count: int = 3) -> list[int]:
    if len(steps) <= count:
        return steps
    return sorted({steps[round(i * (len(steps) - 1) / (count - 1))] for i in range(count)})


CSS = """body{font-family:sans-serif;max-width:1300px;margin:2em auto;padding:0 1em}
.grid{display:flex;flex-wrap:wrap;gap:12px}.grid figure{margin:0}.grid img{width:620px}
table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:2px 8px}"""


def render(run_dirs: list[Path], out: Path, per_step: int = 64) -> Path:
    """Write the PNGs and `report.html` for `run_dirs` into `out`; returns the page's path. The page embeds
    the trajectory viewer (agentrl/view/) over a few steps spread over each run, `per_step` samples each."""
    if not run_dirs:
        raise ConfigError("give at least one run dir")
    names = [d.resolve().name for d in run_dirs]
    if len(set(names)) < len(names):  # same-named dirs in different places: name them by their path
        names = [str(d) for d in run_dirs]
    read = {name: read_metrics(d) for name, d in zip(names, run_dirs, strict=True)}
    images = plots(read)
    out.mkdir(parents=True, exist_ok=True)
    figures = []
    for name, (title, png) in images.items():
        (out / f".{name}.png.tmp").write_bytes(png)
        (out / f".{name}.png.tmp").replace(out / f"{name}.png")
        data = base64.b64encode(png).decode()
        figures.append(f'<figure><img alt="{html.escape(title)}" src="data:image/png;base64,{data}"></figure>')
    rows = []
    for name, metrics in read.items():
        last = metrics[-1]
        cells = [f"{last.get(k):.3g}" if isinstance(last.get(k), (int, float)) else "-"
                 for k in ("reward/mean", "val/score", "rollout/response_length/mean", "tool/calls_per_trajectory")]
        rows.append(f"<tr><td>{html.escape(name)}</td><td>{last['step']}</td><td>{'</td><td>'.join(cells)}</td></tr>")
    picked = {}
    runs = open_runs(list(run_dirs))
    for run in runs:  # a few steps spread over each run, as the viewer names them
        steps = [s["step"] for s in run.steps()]
        picked[run.name] = [steps[i] for i in _picked_steps(list(range(len(steps))))]
    viewer = iframe(runs, picked, per_step) if any(picked.values()) else ""
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>agentrl report</title>
<style>{CSS}</style></head><body><h1>agentrl report</h1>
<table><tr><th>run</th><th>steps</th><th>reward</th><th>val score</th><th>response tokens</th><th>tool calls</th></tr>
{"".join(rows)}</table><p>Last step's values. Tool outputs are marked grey in the trajectories.</p>
<h2>Curves</h2><div class="grid">{"".join(figures)}</div>
<h2>Sampled trajectories</h2>{viewer or "<p>No samples were dumped (trainer.samples_per_step 0).</p>"}
</body></html>
"""
    return atomic_write_text(out / "report.html", page)
