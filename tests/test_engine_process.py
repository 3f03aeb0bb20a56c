"""engine/process.py: an engine in a child process answers exactly as the same engine in this one, weights
update there, errors and cancellations cross, and a dead or failed child is reported, never waited on."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from agentrl.engine import Sampling
from agentrl.engine.hf import HFEngine
from agentrl.engine.process import EngineClosed, ProcessEngine
from tests.conftest import process_gone

FACTORY = "agentrl.engine.hf:HFEngine.from_pretrained"
PROMPTS = ["Compute 2 + 3", "A conversation between User and Assistant.", "who wrote hamlet", "x"]


def _save_model(directory, tokenizer, seed: int) -> str:
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, max_position_embeddings=512,
                      eos_token_id=tokenizer.eos_token_id)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_tokenizer):
    root = tmp_path_factory.mktemp("models")
    return _save_model(root / "a", tiny_tokenizer, 0), _save_model(root / "b", tiny_tokenizer, 1)


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()  # a ProcessEngine's streams belong to the loop that first used it
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def child(models, loop):
    engine = ProcessEngine(FACTORY, {"path": models[0], "max_batch": 1})
    yield engine
    loop.run_until_complete(engine.aclose())


def _ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


async def _answers(engine, tokenizer, sampling):
    return await asyncio.gather(*(engine.generate(_ids(tokenizer, p), sampling, session=str(i))
                                  for i, p in enumerate(PROMPTS)))


@pytest.mark.parametrize("sampling", [Sampling(max_tokens=12, temperature=0), Sampling(max_tokens=12, seed=7)])
def test_the_child_answers_as_the_same_engine_here(models, child, loop, tiny_tokenizer, sampling) -> None:
    here = HFEngine.from_pretrained(models[0], max_batch=1)
    expected = loop.run_until_complete(_answers(here, tiny_tokenizer, sampling))
    got = loop.run_until_complete(_answers(child, tiny_tokenizer, sampling))  # four requests in flight at once
    assert [c.token_ids for c in got] == [c.token_ids for c in expected]
    assert [c.logprobs for c in got] == [c.logprobs for c in expected]  # pickled floats: bit for bit
    assert [c.finish_reason for c in got] == [c.finish_reason for c in expected]
    assert child.max_context_tokens == here.max_context_tokens == 512


def test_errors_in_the_child_are_raised_here_with_its_traceback(child, loop) -> None:
    with pytest.raises(ValueError, match="at least one prompt token") as info:
        loop.run_until_complete(child.generate([], Sampling(max_tokens=4)))
    assert any("raised in the engine process" in note and "hf.py" in note for note in info.value.__notes__)
    with pytest.raises(AttributeError, match="HFEngine has no method 'nope'"):
        loop.run_until_complete(child.call("nope"))
    with pytest.raises(AttributeError, match="no method '_serve'"):  # private methods are not callable from here
        loop.run_until_complete(child.call("_serve"))
    with pytest.raises(KeyError, match="no parameter 'not.a.weight'"):
        loop.run_until_complete(child.update_weights([("not.a.weight", torch.zeros(1))]))
    assert loop.run_until_complete(child.generate([1, 2], Sampling(max_tokens=3, temperature=0))).token_ids  # still serving


class NotInParent:
    """Pickles in the child; unpickling it anywhere else fails."""

    def __reduce__(self):
        return (_rebuild_in, (os.getpid(),))


def _rebuild_in(pid: int) -> NotInParent:
    if os.getpid() != pid:
        raise ImportError("this class exists in the engine process only")
    return NotInParent()


class ProbeEngine:
    """Made in the child by the tests below: requests wait until cancelled, and it counts them."""

    max_context_tokens = 99

    def __init__(self, marker: str | None = None, close_raises: bool = False) -> None:
        self.started = self.cancelled = 0
        self.marker, self.close_raises = marker, close_raises

    async def generate(self, prompt_ids, sampling, *, session=None):
        self.started += 1
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    def counts(self) -> tuple[int, int]:
        return self.started, self.cancelled

    def echo(self, value):
        return value

    def unpicklable(self):
        return lambda: None

    def not_in_parent(self):
        return NotInParent()

    def getenv(self, name: str) -> str | None:
        return os.environ.get(name)

    def die(self) -> None:
        from agentrl.engine import EngineDied

        raise EngineDied("the engine core is gone")

    def start_helper(self) -> int:
        """A process the engine starts and leaves running, as vLLM's engine core is: its pid."""
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]).pid

    async def cancelled_inside(self):
        inner = asyncio.ensure_future(asyncio.Event().wait())
        inner.cancel()
        await inner

    async def aclose(self) -> None:
        if self.marker:
            with open(self.marker, "a") as f:
                f.write("closed\n")
        if self.close_raises:
            raise OSError("the engine could not close")


class SyncCloseProbe(ProbeEngine):
    def aclose(self) -> None:  # a plain method: called all the same
        with open(self.marker, "a") as f:
            f.write("closed\n")


class BytesProbe(ProbeEngine):
    """Takes weights as safetensors bytes (as VLLMEngine does) and records what it got."""

    def __init__(self) -> None:
        super().__init__()
        self.buckets: list[dict] = []
        self.resets = 0

    async def load_weight_bucket(self, payload: bytes) -> int:
        from safetensors.torch import load

        tensors = load(payload)
        self.buckets.append({name: (t.dtype, t.tolist()) for name, t in tensors.items()})
        return len(tensors)

    def weights_loaded(self) -> None:
        self.resets += 1

    async def update_weights(self, named_tensors):
        raise AssertionError("bytes-taking engines get no second encoding")

    def received(self):
        return self.buckets, self.resets


async def _until(engine, counts: tuple[int, int]) -> tuple[int, int]:
    """Ask the child for its counts until they are `counts` (a bound, not a timing: fails after 30 s)."""
    deadline = time.monotonic() + 30
    while (got := await engine.call("counts")) != counts:
        assert got[0] <= counts[0] and got[1] <= counts[1] and time.monotonic() < deadline, got
    return got


@pytest.fixture
def probe():
    loop = asyncio.new_event_loop()
    engine = ProcessEngine(ProbeEngine)
    yield engine, loop
    loop.run_until_complete(engine.aclose())
    loop.close()


def test_a_cancelled_call_is_cancelled_in_the_child_and_leaves_nothing_behind(probe) -> None:
    engine, loop = probe

    async def go():
        waiting = asyncio.create_task(engine.generate([1], Sampling(max_tokens=1)))
        await _until(engine, (1, 0))
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await _until(engine, (1, 1))
        for _ in range(50):  # cancelled before, while and after they reach the child
            task = asyncio.create_task(engine.generate([1], Sampling(max_tokens=1)))
            await asyncio.sleep(0)
            task.cancel()
        deadline = time.monotonic() + 30
        while await engine.call("_tasks"):
            assert time.monotonic() < deadline

    assert engine.max_context_tokens == 99
    loop.run_until_complete(go())
    assert engine._pending == {}


def test_answers_and_arguments_that_cannot_cross_fail_only_their_call(probe) -> None:
    engine, loop = probe
    with pytest.raises(AttributeError, match="Can't pickle") as info:  # the child cannot send it
        loop.run_until_complete(engine.call("unpicklable"))
    assert "raised in the engine process" in info.value.__notes__[0]
    with pytest.raises(RuntimeError, match=r"not_in_parent\(\): the engine process's answer cannot be read here"):
        loop.run_until_complete(engine.call("not_in_parent"))
    with pytest.raises(TypeError, match=r"echo\(\): its arguments cannot be sent"):
        loop.run_until_complete(engine.call("echo", lambda: None))
    with pytest.raises(RuntimeError, match=r"cancelled_inside\(\) was cancelled inside the engine process"):
        loop.run_until_complete(engine.call("cancelled_inside"))
    assert loop.run_until_complete(engine.call("echo", {"still": "serving"})) == {"still": "serving"}
    assert engine._pending == {}


def test_first_call_cancelled_while_connecting_leaves_the_engine_usable(probe) -> None:
    engine, loop = probe

    async def go():
        first = asyncio.create_task(engine.call("echo", 1))
        await asyncio.sleep(0)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        return await engine.call("echo", 2)

    assert loop.run_until_complete(go()) == 2


def test_an_engine_belongs_to_its_first_event_loop(probe) -> None:
    engine, loop = probe
    assert loop.run_until_complete(engine.call("echo", 1)) == 1
    with pytest.raises(RuntimeError, match="belongs to the event loop that first used it"):
        asyncio.run(engine.call("echo", 2))


def test_aclose_fails_waiting_calls_and_later_ones(tmp_path) -> None:
    loop = asyncio.new_event_loop()
    marker = tmp_path / "closed"
    engine = ProcessEngine(ProbeEngine, {"marker": str(marker)})

    async def go():
        waiting = asyncio.create_task(engine.generate([1], Sampling(max_tokens=1)))
        await _until(engine, (1, 0))
        await engine.aclose()
        with pytest.raises(EngineClosed, match="closed"):
            await waiting
        with pytest.raises(EngineClosed, match="closed"):
            await engine.call("echo", 1)
        await engine.aclose()  # twice is harmless

    loop.run_until_complete(go())
    loop.close()
    assert marker.read_text() == "closed\n" and engine.process.exitcode == 0 and not os.path.exists(engine._dir)


@pytest.mark.parametrize("factory", [ProbeEngine, SyncCloseProbe])
def test_the_child_closes_its_engine_when_the_parent_goes(tmp_path, factory) -> None:
    marker = tmp_path / "closed"
    engine = ProcessEngine(factory, {"marker": str(marker)})
    engine._sock.close()  # as when the parent process dies: the child reads the end of its socket
    engine.process.join(60)
    assert engine.process.exitcode == 0 and marker.read_text() == "closed\n"
    engine._finalizer()


def test_an_error_closing_the_engine_is_raised_by_aclose() -> None:
    engine = ProcessEngine(ProbeEngine, {"close_raises": True})
    with pytest.raises(OSError, match="could not close"):
        asyncio.run(engine.aclose())
    assert not engine.process.is_alive()


def test_env_is_the_childs_only_and_weights_wait_for_generation(probe) -> None:
    engine, loop = probe
    assert "AGENTRL_PROBE" not in os.environ
    with_env = ProcessEngine(ProbeEngine, env={"AGENTRL_PROBE": "x"})
    try:
        assert asyncio.run(with_env.call("getenv", "AGENTRL_PROBE")) == "x"
    finally:
        asyncio.run(with_env.aclose())  # from another loop: the child is ended through its socket
    assert "AGENTRL_PROBE" not in os.environ

    async def go():
        waiting = asyncio.create_task(engine.generate([1], Sampling(max_tokens=1)))
        await _until(engine, (1, 0))
        with pytest.raises(RuntimeError, match="1 requests are still generating"):
            await engine.update_weights([("w", torch.zeros(1))])
        waiting.cancel()

    loop.run_until_complete(go())


def test_a_script_that_never_calls_aclose_still_exits(tmp_path) -> None:
    """The child is ended at interpreter exit, also when a weakref.finalize made before multiprocessing was
    imported would otherwise run after multiprocessing joins its children."""
    marker = tmp_path / "closed"
    script = (
        "import tempfile; keep = tempfile.TemporaryDirectory()\n"
        "from agentrl.engine.process import ProcessEngine\n"
        "from tests.test_engine_process import ProbeEngine\n"
        f"engine = ProcessEngine(ProbeEngine, {{'marker': {str(marker)!r}}})\n"
        "print(engine.process.pid)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr
    pid = int(done.stdout.split()[-1])
    assert marker.read_text() == "closed\n"
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_weights_update_in_the_child(models, loop, tiny_tokenizer) -> None:
    engine = ProcessEngine(FACTORY, {"path": models[0], "max_batch": 1})
    greedy = Sampling(max_tokens=12, temperature=0)
    try:
        before = loop.run_until_complete(_answers(engine, tiny_tokenizer, greedy))
        b = HFEngine.from_pretrained(models[1], max_batch=1)
        loop.run_until_complete(engine.update_weights(b.model.named_parameters()))
        after = loop.run_until_complete(_answers(engine, tiny_tokenizer, greedy))
        expected = loop.run_until_complete(_answers(b, tiny_tokenizer, greedy))
    finally:
        loop.run_until_complete(engine.aclose())
    assert [c.token_ids for c in after] == [c.token_ids for c in expected]
    assert [c.logprobs for c in after] == [c.logprobs for c in expected]
    assert [c.logprobs for c in after] != [c.logprobs for c in before]
    assert engine.process.exitcode == 0 and not os.path.exists(engine._dir)


def test_a_dead_child_fails_every_call_with_its_exit_code(probe) -> None:
    engine, loop = probe

    async def go():
        pending = asyncio.create_task(engine.generate([1], Sampling(max_tokens=1)))
        await _until(engine, (1, 0))
        os.kill(engine.process.pid, signal.SIGKILL)
        with pytest.raises(EngineClosed, match=r"engine process exited \(exit code -9\)"):
            await pending
        with pytest.raises(EngineClosed, match="exit code -9"):
            await engine.generate([1], Sampling(max_tokens=1))

    loop.run_until_complete(go())


def test_what_a_killed_child_started_is_ended_with_it_and_a_restart_serves_again(probe) -> None:
    engine, loop = probe

    async def go():
        helper = await engine.call("start_helper")
        os.kill(engine.process.pid, signal.SIGKILL)  # the child dies; its helper would live on, orphaned
        with pytest.raises(EngineClosed, match="exit code -9"):
            await engine.call("echo", 1)
        assert not process_gone(helper, within_s=0.5)
        await engine.restart()
        assert process_gone(helper) and engine.restarts == 1
        assert await engine.call("echo", 2) == 2

    loop.run_until_complete(go())


def test_an_engine_that_died_ends_its_process_which_a_restart_replaces(probe) -> None:
    engine, loop = probe

    async def go():
        waiting = asyncio.create_task(engine.generate([1], Sampling(max_tokens=1)))
        await _until(engine, (1, 0))
        with pytest.raises(EngineClosed, match=r"exit code 75"):  # not an error of this call alone
            await engine.call("die")
        with pytest.raises(EngineClosed, match=r"exit code 75"):  # the others fail with it
            await waiting
        await engine.restart()
        assert await engine.call("echo", 3) == 3

    loop.run_until_complete(go())


def test_a_child_that_cannot_make_its_engine_says_why(tmp_path) -> None:
    with pytest.raises(RuntimeError, match="could not make agentrl.engine.hf:HFEngine.from_pretrained") as info:
        ProcessEngine(FACTORY, {"path": str(tmp_path / "missing")})
    assert isinstance(info.value.__cause__, OSError) and "missing" in str(info.value.__cause__)
    with pytest.raises(RuntimeError, match="could not make"):
        ProcessEngine(FACTORY, {"path": str(tmp_path), "no_such_option": 1})
    with pytest.raises(ValueError, match="module-level"):
        ProcessEngine(lambda: None)
    with pytest.raises(ModuleNotFoundError):
        try:
            ProcessEngine("agentrl.no_such_module:Engine")
        except RuntimeError as e:
            raise e.__cause__ from None


def test_weights_reach_a_bytes_taking_engine_as_sent_then_one_reset(monkeypatch) -> None:
    import agentrl.engine.weights

    monkeypatch.setattr(agentrl.engine.weights, "BUCKET_BYTES", 16)  # a bucket per tensor or two
    base = torch.arange(12, dtype=torch.float32)
    weights = [("a", base[:4]), ("b", base[4:].view(2, 4)), ("c", torch.tensor([1.5, -2.0], dtype=torch.bfloat16))]
    engine = ProcessEngine(BytesProbe)

    async def go():
        count = await engine.update_weights(weights)
        return count, await engine.call("received")

    try:
        count, (buckets, resets) = asyncio.run(go())
    finally:
        asyncio.run(engine.aclose())
    got = {name: value for bucket in buckets for name, value in bucket.items()}
    assert count == 3 and len(buckets) == 3 and resets == 1
    assert got == {"a": (torch.float32, [0.0, 1.0, 2.0, 3.0]), "b": (torch.float32, [[4.0, 5.0, 6.0, 7.0], [8.0, 9.0, 10.0, 11.0]]),
                   "c": (torch.bfloat16, [1.5, -2.0])}


class StuckLoadProbe(BytesProbe):
    """A bucket load that never finishes: counts it as a started request."""

    async def load_weight_bucket(self, payload: bytes) -> int:
        self.started += 1
        await asyncio.Event().wait()
        return 0


def test_generation_is_refused_while_weights_load() -> None:
    engine = ProcessEngine(StuckLoadProbe)

    async def go():
        loading = asyncio.create_task(engine.update_weights([("w", torch.zeros(2))]))
        await _until(engine, (1, 0))
        with pytest.raises(RuntimeError, match="generate between weight updates"):
            await asyncio.wait_for(engine.generate([1], Sampling(max_tokens=1)), 30)  # a bound: refused at once
        loading.cancel()
        with pytest.raises(asyncio.CancelledError):
            await loading
        waiting = asyncio.create_task(engine.generate([1], Sampling(max_tokens=1)))  # allowed again after it
        await _until(engine, (2, 0))  # the load and this request have reached the child
        waiting.cancel()
        await engine.aclose()

    asyncio.run(go())
