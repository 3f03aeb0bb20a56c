"""Helpers for the learner tests: a tiny random Qwen2, multi-turn trajectories, a padded HF reference."""

from __future__ import annotations

import random

import torch

from agentrl.types import Prompt, RewardResult, Segment, StopReason, Trajectory

VOCAB = 96


def tiny_lm(seed: int = 0, tie: bool = True, layers: int = 2, vocab: int = VOCAB, hidden: int = 64,
            device: str = "cpu"):
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=2 * hidden, tie_word_embeddings=tie, max_position_embeddings=1024,
    )
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config).float()


def trajectories(n: int, seed: int = 0, group_size: int = 2, max_prompt: int = 12, max_turn: int = 10,
                 vocab: int = VOCAB) -> list[Trajectory]:
    """n trajectories of 1-3 model turns with tool observations between them; groups of `group_size`."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        group = i // group_size
        prompt_ids = tuple(rng.randrange(vocab) for _ in range(rng.randint(2, max_prompt)))
        prompt = Prompt(id=f"p{group}", text="", token_ids=prompt_ids, question="", ground_truth="")
        segments = []
        turns = rng.randint(1, 3)
        for turn in range(turns):
            ids = [rng.randrange(vocab) for _ in range(rng.randint(1, max_turn))]
            segments.append(Segment("model", ids, [-rng.uniform(0.1, 4.0) for _ in ids]))
            if turn < turns - 1:
                segments.append(Segment("tool", [rng.randrange(vocab) for _ in range(rng.randint(1, 6))]))
        out.append(Trajectory(prompt=prompt, segments=segments, stop_reason=StopReason.EOS, sample=i % group_size,
                              reward=RewardResult(float(rng.random() < 0.5))))
    return out


def padded_logprobs(lm, trajs: list[Trajectory], temperature: float = 1.0,
                    dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain HF forward on right-padded rows with an attention mask -> (logprobs_BR, entropy_BR) of the
    response tokens under softmax(logits / temperature) in `dtype`, the reference the packed path must
    match (differentiable in the model's parameters)."""
    seqs = [list(t.prompt.token_ids) + t.response_ids for t in trajs]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    attn = torch.zeros(len(seqs), width, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = torch.tensor(s)
        attn[b, : len(s)] = 1
    logits = lm(input_ids=ids.to(lm.device), attention_mask=attn.to(lm.device)).logits.to(dtype).cpu()
    logp = torch.log_softmax(logits / temperature, -1)
    resp = max(len(t.response_ids) for t in trajs)
    lp_BR = torch.zeros(len(trajs), resp, dtype=dtype)
    ent_BR = torch.zeros(len(trajs), resp, dtype=dtype)
    for b, t in enumerate(trajs):
        p, r = len(t.prompt.token_ids), len(t.response_ids)
        rows = logp[b, p - 1 : p - 1 + r]
        lp_BR[b, :r] = rows.gather(1, torch.tensor(t.response_ids)[:, None]).squeeze(1)
        ent_BR[b, :r] = -(rows.exp() * rows).sum(-1)
    return lp_BR, ent_BR


def assert_fused_accumulation_is_fsdps(fused, plain, accumulation, batch) -> None:
    """Two train steps of `fused` (through `accumulation`, an fsdp.FusedGradAccumulation) and of `plain`
    (FSDP's own accumulation) on `batch`: the fused path made the sums (per step once a copy, then one add
    per later micro-batch), and grad norms and parameters are FSDP's to the bit. Over two steps: the second
    starts a new float32 buffer."""
    calls = {"copy": 0, "add": 0}
    for name in calls:
        inner = getattr(accumulation, f"_{name}")

        def counted(dst, src, inner=inner, name=name):
            calls[name] += 1
            inner(dst, src)
        setattr(accumulation, f"_{name}", counted)
    fused.grad_accumulation, plain.grad_accumulation = accumulation, None
    n = len(batch.micro_batches)
    assert n > 2
    for step in (1, 2):
        m_fused, m_plain = fused.train_step(batch), plain.train_step(batch)
        assert calls == {"copy": step, "add": step * (n - 1)}
        assert m_fused["actor/grad_norm"] == m_plain["actor/grad_norm"] > 0
    for (name, a), (_, b) in zip(fused.module.named_parameters(), plain.module.named_parameters(), strict=True):
        assert torch.equal(a.full_tensor(), b.full_tensor()), name
