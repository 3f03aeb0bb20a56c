"""Supervised fine-tuning on trajectories: `agentrl sft CONFIG`, e.g. to warm-start a policy before RL.

The data is JSONL, one trajectory per line, in either form:
- the trainer's own dumps (`samples/step_N.jsonl`): `{"prompt": text, "segments": [{"source": "model" |
  "tool", "text": ...}, ...]}`;
- chat messages with tool turns: `{"messages": [{"role": "system" | "user" | "assistant" | "tool", "content":
  ...}, ...]}`, rendered with the tokenizer's chat template; the prompt is everything before the first
  assistant message, each assistant message is a model segment, everything between them a tool segment.

Training is masked as in RL: only model-written tokens are trained on (`Trajectory.loss_mask`), never the
prompt or a tool's output. It runs on the RL learner (PolicyWorker) with an advantage of 1 on every token
and the ratio taken on-policy, whose gradient is that of the tokens' negative log-likelihood (mean over
tokens), so checkpoints, export and the run dir (run_dir.py, resume included) are the trainer's.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from agentrl.algo import AlgoConfig
from agentrl.config import ConfigError, StrictModel, write_resolved
from agentrl.learner.config import LearnerConfig
from agentrl.learner.packing import pack, response_layout
from agentrl.run_config import LoggingConfig, ModelConfig, agree
from agentrl.run_dir import MetricsLog, RunDir
from agentrl.types import Prompt, Segment, StopReason, Trajectory


class SFTSchedule(StrictModel):
    epochs: int = Field(1, ge=1)
    batch_size: int = Field(16, ge=1, description="trajectories per optimizer step")
    seed: int = 0
    run_dir: str = "runs/{name}"
    save_every: int = Field(0, ge=0, description="checkpoint every k steps (and always at the end)")
    keep_checkpoints: int = Field(2, ge=1)
    export: bool = True


class SFTConfig(StrictModel):
    name: str
    data: str = Field(description="a trajectories JSONL file (trainer dumps or chat messages)")
    model: ModelConfig
    learner: LearnerConfig = LearnerConfig()
    trainer: SFTSchedule = SFTSchedule()
    logging: LoggingConfig = LoggingConfig()

    @model_validator(mode="after")
    def _derive(self) -> SFTConfig:
        """As RunConfig's: the learner takes model.path and trainer.seed; a different value is an error."""
        if self.model.path is not None:
            agree(self.learner, "model", self.model.path, "learner.model", "model.path")
        if self.model.lora is not None:  # SFT of an adapter: the export is merged, the adapter beside it
            agree(self.learner, "lora", self.model.lora, "learner.lora", "model.lora")
        agree(self.learner, "seed", self.trainer.seed, "learner.seed", "trainer.seed")
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.trainer.run_dir.replace("{name}", self.name))


def read_trajectories(path: str | Path, tokenizer: Any) -> list[Trajectory]:
    """The JSONL file's trajectories, tokenized; ConfigError naming the line for a malformed one."""
    out = []
    for n, line in enumerate(Path(path).read_text().split("\n"), 1):  # not splitlines(): see config.read_jsonl
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if "segments" in row:
                out.append(_from_dump(row, tokenizer, n))
            elif "messages" in row:
                out.append(_from_messages(row["messages"], tokenizer, n))
            else:
                raise ValueError("expected 'prompt' and 'segments' (a trainer dump) or 'messages' (chat)")
        except (ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{path}: line {n}: {e}") from None
    if not out:
        raise ConfigError(f"{path}: no trajectories in the file")
    return out


def _from_dump(row: dict[str, Any], tokenizer: Any, n: int) -> Trajectory:
    prompt_ids = tokenizer(row["prompt"])["input_ids"]
    segments = []
    for s in row["segments"]:
        if s["source"] not in ("model", "tool"):
            raise ValueError(f"segment source {s['source']!r}: expected 'model' or 'tool'")
        ids = tokenizer.encode(s["text"], add_special_tokens=False)
        segments.append(Segment(s["source"], ids, [0.0] * len(ids) if s["source"] == "model" else None))
    return _trajectory(str(row.get("id", n)), row["prompt"], prompt_ids, segments)


def _from_messages(messages: list[dict[str, str]], tokenizer: Any, n: int) -> Trajectory:
    """The chat rendered once per message boundary; each message's tokens are what its rendering adds."""
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
    if first is None:
        raise ValueError("the messages hold no assistant message to train on")

    def ids(upto: int, generation_prompt: bool) -> list[int]:
        return tokenizer.apply_chat_template(messages[:upto], tokenize=True, add_generation_prompt=generation_prompt,
                                             return_dict=False)

    prompt_ids = ids(first, True)
    segments, done = [], prompt_ids
    for i in range(first, len(messages)):
        assistant = messages[i]["role"] == "assistant"
        nxt = i + 1 < len(messages) and messages[i + 1]["role"] == "assistant"
        now = ids(i + 1, nxt)  # before an assistant message: its generation prompt is the tool segment's end
        if now[: len(done)] != done:
            raise ValueError("the chat template does not render the conversation as a growing prefix")
        piece = now[len(done):]
        if piece:
            segments.append(Segment("model" if assistant else "tool", piece, [0.0] * len(piece) if assistant else None))
        done = now
    text = tokenizer.decode(prompt_ids)
    return _trajectory(str(n), text, prompt_ids, segments)


def _trajectory(id_: str, text: str, prompt_ids: list[int], segments: list[Segment]) -> Trajectory:
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    if not any(s.source == "model" for s in segments):
        raise ValueError("no model-written text to train on")
    return Trajectory(Prompt(id_, text, tuple(prompt_ids), "", ""), segments, StopReason.EOS)


def sft(config: SFTConfig) -> RunDir:
    """Fine-tune `config.model` on `config.data`; resumes from its run dir's latest checkpoint."""
    from agentrl.build import build_lm, run_tokenizer
    from agentrl.learner.policy import PolicyWorker
    from agentrl.prompt_order import PromptSampler

    tokenizer = run_tokenizer(config)
    data = read_trajectories(config.data, tokenizer)
    t = config.trainer
    steps_per_epoch = math.ceil(len(data) / t.batch_size)
    total = t.epochs * steps_per_epoch
    config.learner.optim = config.learner.optim.for_run(total)  # a cosine without its end ends at the last step
    run_dir = RunDir(config.run_dir)
    run_dir.create()
    policy = PolicyWorker(config.learner, AlgoConfig(loss_agg="token_mean", tis_cap=None), model=build_lm(config))
    step = 0
    if (found := run_dir.resume()) is not None:
        path, state = found
        policy.load(str(path / "actor"))
        step = int(state["step"])
    write_resolved(config, run_dir.root)
    with MetricsLog(run_dir, config.logging, step, total, config) as log:
        while step < total:
            # the trainer's seeded permutation per epoch; its position follows from the step
            epoch, index = divmod(step * t.batch_size, len(data))
            batch_rows = [tr for _, tr in PromptSampler(data, t.seed, epoch, index).take(t.batch_size)]
            step += 1
            start = time.perf_counter()
            batch = pack(batch_rows, config.learner.token_budget, policy.ctx.world_size)[policy.ctx.rank]
            batch.set("advantages", response_layout(batch_rows).mask_BR)  # 1 on every model token: the NLL's gradient
            metrics = policy.train_step(batch)
            policy.end_step()
            metrics["sft/nll"] = metrics["actor/nll"]  # the training forward's, under the weights before the step
            metrics |= {"sft/epoch": float(epoch), "timing/step": time.perf_counter() - start}
            if step == total or (t.save_every and step % t.save_every == 0):
                run_dir.save_checkpoint(step, {"step": step}, lambda tmp, s=step: policy.save(str(tmp / "actor"),
                                        extra={"step": s}), t.keep_checkpoints)
            log(step, metrics)
    if t.export:
        policy.export_hf(str(run_dir.export), tokenizer=tokenizer)
    return run_dir
