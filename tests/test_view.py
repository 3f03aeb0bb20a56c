"""`agentrl view` (agentrl/view/): the dumps' per-token arrays equal the batch's, the API answers from run
dirs and eval dirs as they are written, and the page works in a real browser (headless Chromium through
selenium) on a run the test trains, and inside `agentrl report`'s single file. Screenshots go to the test's
temporary directory."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import threading
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from agentrl.samples import trajectory_record
from agentrl.types import Prompt, RewardResult, Segment, StopReason, Trajectory
from agentrl.view.server import app_for
from tests.conftest import REPO
from tests.test_trainer import CODE_TURN, ScriptedEngine, config


class MixedScript(ScriptedEngine):
    """Even samples call the interpreter and then answer; odd ones answer at once."""

    async def generate(self, prompt_ids, sampling, *, session=None):
        if session is not None and int(session.rsplit("/", 1)[1]) % 2:
            turns, self.turns = self.turns, ["So it is \\boxed{7}."]
            try:
                return await super().generate(prompt_ids, sampling, session=session)
            finally:
                self.turns = turns
        return await super().generate(prompt_ids, sampling, session=session)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """Three steps of the debug config, two prompts x 4 samples each step (the same two every step), two
    mini-batches (so the step computes the learner's logprobs before it), every sample dumped."""
    import os

    from agentrl.task import load_tokenizer
    from agentrl.trainer import Trainer

    tmp = tmp_path_factory.mktemp("view")
    cwd = os.getcwd()
    os.chdir(REPO)
    try:
        cfg = config(tmp, "trainer.steps=3", "task.dataset.limit=2", "trainer.prompts_per_step=2",
                     "trainer.mini_batches=2", "trainer.samples_per_step=8", "trainer.eval_every=0",
                     "trainer.export=false", "trainer.save_every=0", "trainer.probe_tokens=0",
                     "task.budgets.max_response_tokens=200")
        engine = MixedScript(load_tokenizer("configs/tiny_tokenizer"), [CODE_TURN, "So it is \\boxed{42}."])
        return asyncio.run(Trainer(cfg, engine=engine).run()).root
    finally:
        os.chdir(cwd)


def test_a_dumped_samples_arrays_equal_the_batchs(tiny_tokenizer):
    from agentrl.learner.packing import response_layout

    tok = tiny_tokenizer
    ids = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    def model(text: str, version: int) -> Segment:
        return Segment("model", ids(text), [-0.25 * (k + 1) for k in range(len(ids(text)))], version)

    t = Trajectory(Prompt("p", "Q", tuple(ids("Q")), "Q", "1"), [model("a b", 3), Segment("tool", ids("out")),
                                                                  model("c d", 4)], StopReason.EOS,
                   reward=RewardResult(1.0))
    t.learner = {"advantage": 0.5, "logprobs": [-0.1 * k for k in range(len(t.response_ids))]}
    r = trajectory_record(t, tok)
    layout = response_layout([t])
    n = len(t.response_ids)
    assert [i for s in r["segments"] for i in s["ids"]] == t.response_ids
    assert [int(s["source"] == "model") for s in r["segments"] for _ in s["ids"]] == layout.mask_BR[0, :n].tolist()
    engine = [lp for s in r["segments"] for lp in s.get("logprobs", [0.0] * s["tokens"])]
    assert engine == pytest.approx(layout.engine_logprobs_BR[0, :n].tolist())
    assert [s.get("version") for s in r["segments"]] == [3, None, 4]
    assert "".join(p for s in r["segments"] for p in s["pieces"]) == tok.decode(t.response_ids)
    model_positions = [k for k, m in enumerate(t.loss_mask) if m]
    learner = [lp for s in r["segments"] for lp in s.get("learner_logprobs", [])]
    assert learner == pytest.approx([t.learner["logprobs"][k] for k in model_positions])


def test_the_index_written_beside_a_step_is_the_one_read_from_its_samples(run):
    from agentrl.samples import index_path, newest_version, summary

    path = run / "samples/step_2.jsonl"
    written = json.loads(index_path(path).read_text())
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert written["size"] == path.stat().st_size
    assert written["rows"] == [summary(i, r, newest_version(records)) for i, r in enumerate(records)]
    with path.open("rb") as f:
        for offset, r in zip(written["offsets"], records, strict=True):
            f.seek(offset)
            assert json.loads(f.readline()) == r


def test_the_api_lists_filters_and_opens_samples_of_a_run_as_it_grows(run, tmp_path):
    live = tmp_path / "live"
    shutil.copytree(run, live, ignore=shutil.ignore_patterns("step_3.jsonl"))
    client = TestClient(app_for([live]), base_url="http://127.0.0.1")
    [listed] = client.get("/api/runs").json()
    assert listed["kind"] == "train" and [s["step"] for s in listed["steps"]] == ["1", "2"]
    rows = [json.loads(line) for line in (run / "samples/step_3.jsonl").read_text().splitlines()]
    with (live / "samples/step_3.jsonl").open("w") as f:  # a step landing, its last line half-written
        f.write("".join(json.dumps(r) + "\n" for r in rows[:-1]) + json.dumps(rows[-1])[:40])
    assert [s["step"] for s in client.get("/api/runs").json()[0]["steps"]] == ["1", "2", "3"]
    assert client.get("/api/runs/live/steps/3").json()["total"] == len(rows) - 1
    step = client.get("/api/runs/live/steps/2").json()
    called = [r for r in step["rows"] if r["tool_calls"]]
    assert step["total"] == 8 and len(called) == 4  # the even samples
    assert client.get("/api/runs/live/steps/2", params={"tool": "none"}).json()["rows"] == [
        r for r in step["rows"] if not r["tool_calls"]]
    assert len(client.get("/api/runs/live/steps/2", params={"q": "boxed{7}"}).json()["rows"]) == 4
    one = client.get(f"/api/runs/live/steps/2/{called[0]['i']}").json()
    assert [s["source"] for s in one["record"]["segments"]] == ["model", "tool", "model"]
    assert all("learner_logprobs" in s for s in one["record"]["segments"] if s["source"] == "model")
    across = client.get(f"/api/runs/live/prompts/{called[0]['prompt_id']}").json()
    pid = called[0]["prompt_id"]
    assert sorted({r["step"] for r in across}) == ["1", "2", "3"]
    assert len(across) == 4 + 4 + sum(r["id"] == pid for r in rows[:-1])  # step 3 without its unfinished line
    assert client.get("/api/runs/live/steps/9").status_code == 404


def test_an_eval_dir_is_a_run_whose_steps_are_its_benchmarks(tmp_path):
    record = {"prompt_id": "a", "sample": 0, "score": 1.0, "correct": True, "stop_reason": "eos", "prompt": "Q",
              "segments": [{"source": "model", "text": "x", "tokens": 1}], "calls": []}
    (tmp_path / "math500.samples.jsonl").write_text(json.dumps(record) + "\n")
    (tmp_path / "results.json").write_text(json.dumps({"results": {"math500": {"pass@1": 1.0}}}))
    client = TestClient(app_for([tmp_path]), base_url="http://127.0.0.1")
    [listed] = client.get("/api/runs").json()
    assert listed["kind"] == "eval" and listed["steps"] == [{"step": "math500", "pass@1": 1.0}]
    assert client.get(f"/api/runs/{tmp_path.name}/steps/math500").json()["rows"][0]["score"] == 1.0


def test_run_names_are_url_segments_and_only_local_hosts_are_answered(run, tmp_path, monkeypatch):
    from agentrl.view.data import open_runs

    twin = tmp_path / "a" / run.name
    shutil.copytree(run, twin)
    monkeypatch.chdir(run)
    names = [r.name for r in open_runs([Path("."), run, twin])]
    assert names == [f"{run.parent.name}-{run.name}-1", f"{run.parent.name}-{run.name}-2", f"a-{run.name}"]
    assert all("/" not in n and n for n in names)
    app = app_for([run])
    assert TestClient(app, base_url="http://localhost").get("/api/runs").status_code == 200
    assert TestClient(app, base_url="http://attacker.example").get("/api/runs").status_code == 400


def test_a_trajectorys_text_cannot_break_out_of_the_embedded_page(run, tmp_path):
    from agentrl.view.data import open_runs
    from agentrl.view.embed import embedded_page

    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    path = copy / "samples/step_1.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows[0]["segments"][0]["text"] = "<!--<script></script><b>&amp;"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    page = embedded_page(open_runs([copy]), {"run": ["1"]}, 8)
    data = page.split("window.AGENTRL_EMBED = ", 1)[1].split(";</script>", 1)[0]
    assert "<" not in data and ">" not in data and "&" not in data
    assert json.loads(data)["data"]["run"]["steps"]["1"]["records"][0]["segments"][0]["text"].startswith("<!--<script>")


# --- in a real browser ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser():
    if not (shutil.which("chromium") and shutil.which("chromedriver")):
        pytest.skip("needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver; "
                    ".ci/run installs them)")
    from selenium import webdriver

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1400,1000"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(shutil.which("chromedriver")))
    yield driver
    driver.quit()


@contextlib.contextmanager
def serving(paths: list[Path]):
    """`agentrl view`'s app over `paths` on a free loopback port, in a thread; yields its URL."""
    import uvicorn

    from agentrl.learner.fsdp import free_port

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app_for(paths), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)  # polling the server's own started flag, not a fixed wait
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture
def served(run):
    with serving([run]) as url:
        yield url


def _wait(driver, css, count=None):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    def found(d):
        elements = d.find_elements(By.CSS_SELECTOR, css)
        return elements if elements and (count is None or len(elements) == count) else False

    return WebDriverWait(driver, 20).until(found)


def test_the_page_filters_shows_a_trajectory_shades_it_and_follows_a_prompt(browser, served, run, tmp_path):
    from selenium.webdriver.support.ui import Select

    d = browser
    d.get(served)
    steps = _wait(d, ".pane .step", 3)
    steps[-1].click()
    _wait(d, ".pane .list .row", 8)
    assert d.find_element("css selector", ".pane .count").text == "8 of 8"
    Select(d.find_element("css selector", ".f-tool")).select_by_value("called")
    rows = _wait(d, ".pane .list .row", 4)
    assert d.find_element("css selector", ".pane .count").text == "4 of 8"
    d.save_screenshot(str(tmp_path / "list.png"))
    rows[0].click()
    masked = _wait(d, ".detail .seg.tool .tok.masked")
    assert all("masked" in t.get_attribute("class") for t in masked)
    assert not d.find_elements("css selector", ".detail .seg.model .tok.masked")
    Select(d.find_element("css selector", ".shade")).select_by_value("gap")
    shaded = _wait(d, ".detail .seg.model .tok.shaded")
    assert all(t.value_of_css_property("background-color") not in ("rgba(0, 0, 0, 0)", "") for t in shaded)
    d.save_screenshot(str(tmp_path / "trajectory.png"))
    d.find_element("css selector", "button.across").click()
    related = _wait(d, ".related .rel", 12)  # the prompt's 4 samples in each of the 3 steps
    assert {r.text.split(" · ")[0] for r in related} == {"step 1", "step 2", "step 3"}
    d.find_element("css selector", "button.group").click()
    _wait(d, ".related table.group tr.rel", 4)  # the prompt's 4 samples at this step
    d.find_element("css selector", "#tab-curves").click()
    _wait(d, "#curves svg polyline")
    d.save_screenshot(str(tmp_path / "curves.png"))
    assert (tmp_path / "trajectory.png").stat().st_size > 10_000


def test_two_runs_are_shown_side_by_side(browser, run, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(run, other)
    with serving([run, other]) as url:
        browser.get(url)
        _wait(browser, ".pane .step", 6)  # each pane lists its run's 3 steps
        panes = browser.find_elements("css selector", ".pane select.run")
        assert [p.get_attribute("value") for p in panes] == [run.name, "other"]


def test_the_report_embeds_the_viewer_in_its_one_file(browser, run, tmp_path):
    from typer.testing import CliRunner

    from agentrl.cli import app

    result = CliRunner().invoke(app, ["report", str(run), "--out", str(tmp_path / "rep")])
    assert result.exit_code == 0, result.output
    browser.get((tmp_path / "rep/report.html").as_uri())
    browser.switch_to.frame(_wait(browser, "iframe.viewer")[0])
    try:
        _wait(browser, ".pane .step")[0].click()
        _wait(browser, ".pane .list .row", 8)[0].click()
        _wait(browser, ".detail .seg.model .tok")
    finally:
        browser.switch_to.default_content()
