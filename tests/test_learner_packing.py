"""Packing (agentrl/learner/packing.py): layout, alignment with Trajectory.loss_mask, rank balance."""

from __future__ import annotations

import pytest
import torch

from agentrl.learner.packing import pack, response_layout
from agentrl.types import Prompt, Segment, StopReason, Trajectory
from tests.learner_util import trajectories


def _traj(prompt: list[int], segments: list[Segment]) -> Trajectory:
    return Trajectory(Prompt("p", "", tuple(prompt), "", ""), segments, StopReason.EOS)


def test_layout_of_one_micro_batch() -> None:
    a = _traj([10, 11], [Segment("model", [12, 13], [-0.1, -0.2]), Segment("tool", [14]), Segment("model", [15], [-0.3])])
    b = _traj([20], [Segment("model", [21, 22], [-0.4, -0.5])])
    [batch] = pack([a, b], token_budget=100)
    [mb] = batch.micro_batches
    # first-fit-decreasing puts the longer sequence (a: 6 tokens) first
    assert mb.input_ids_T.tolist() == [10, 11, 12, 13, 14, 15, 20, 21, 22]
    assert mb.position_ids_T.tolist() == [0, 1, 2, 3, 4, 5, 0, 1, 2]
    assert mb.cu_seqlens_S.tolist() == [0, 6, 9] and mb.cu_seqlens_S.dtype == torch.int32
    assert mb.max_seqlen == 6
    # position t predicts token t + 1 of its own sequence; the last position of each predicts nothing
    assert mb.target_ids_T.tolist() == [11, 12, 13, 14, 15, 0, 21, 22, 0]
    assert mb.loss_mask_T.tolist() == [0, 1, 1, 0, 1, 0, 1, 1, 0]
    assert mb.engine_logprobs_T.tolist() == pytest.approx([0, -0.1, -0.2, 0, -0.3, 0, -0.4, -0.5, 0])
    assert mb.seq_index_T.tolist() == [0] * 6 + [1] * 3
    assert mb.rows == [0, 1]
    R = batch.max_response_len
    assert R == 4
    assert mb.response_index_T.tolist() == [-1, 0, 1, 2, 3, -1, R, R + 1, -1]
    assert (batch.num_rows, batch.num_loss_tokens, batch.num_loss_sequences) == (2, 5, 2)


def test_loss_mask_comes_from_trajectory() -> None:
    trajs = trajectories(12, seed=5)
    layout = response_layout(trajs)
    batches = pack(trajs, token_budget=30, world_size=2)
    mask_BR = torch.zeros_like(layout.mask_BR)
    for batch in batches:
        mask_BR += batch.gather([mb.loss_mask_T for mb in batch.micro_batches])
    assert torch.equal(mask_BR, layout.mask_BR)
    for b, t in enumerate(trajs):
        assert layout.mask_BR[b, : len(t.loss_mask)].tolist() == [float(m) for m in t.loss_mask]
    assert sum(b.num_tokens for b in batches) == sum(len(t.prompt.token_ids) + len(t.response_ids) for t in trajs)


def test_set_and_gather_round_trip() -> None:
    trajs = trajectories(9, seed=2)
    batches = pack(trajs, token_budget=25, world_size=3)
    values = torch.randn(batches[0].num_rows, batches[0].max_response_len)
    lens = response_layout(trajs).response_lens_B
    valid = torch.arange(values.shape[1])[None, :] < lens[:, None]
    total = torch.zeros_like(values)
    for batch in batches:
        batch.set("advantages", values)
        total += batch.gather([mb.advantages_T for mb in batch.micro_batches])
    assert torch.equal(total, values * valid)
    with pytest.raises(ValueError, match="shape"):
        batches[0].set("advantages", values[:, :-1])


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_budget_balance_and_equal_micro_batch_counts(world_size: int) -> None:
    trajs = trajectories(17, seed=world_size)
    budget = 28
    lengths = {i: len(t.prompt.token_ids) + len(t.response_ids) for i, t in enumerate(trajs)}
    batches = pack(trajs, budget, world_size)
    assert len({len(b.micro_batches) for b in batches}) == 1
    seen = []
    for rank, batch in enumerate(batches):
        assert (batch.rank, batch.world_size) == (rank, world_size)
        for mb in batch.micro_batches:
            assert mb.num_tokens <= budget or len(mb.rows) == 1  # only a lone sequence may exceed it
            seen += [r for r in mb.rows if r >= 0]
    assert sorted(seen) == list(range(len(trajs)))  # every trajectory exactly once
    loads = [b.num_tokens for b in batches]
    assert max(loads) - min(loads) <= max(lengths.values())  # balanced to within one sequence


def test_filler_micro_batch_and_oversized_sequence() -> None:
    long = _traj(list(range(1, 9)), [Segment("model", [1, 2, 3], [-1.0] * 3)])  # 11 tokens > budget 6
    short = _traj([1], [Segment("model", [2], [-1.0])])
    batches = pack([long, short], token_budget=6, world_size=2)
    counts = [len(b.micro_batches) for b in batches]
    assert counts == [1, 1]
    assert batches[0].micro_batches[0].num_tokens == 11  # alone, over budget
    three = pack([long, short, short], token_budget=2, world_size=2)
    # rank 0 holds the long one (1 micro-batch), rank 1 the two short ones (2): rank 0 gets a filler
    assert [len(b.micro_batches) for b in three] == [2, 2]
    filler = three[0].micro_batches[1]
    assert filler.rows == [-1] and filler.num_tokens == 1 and float(filler.loss_mask_T.sum()) == 0.0


def test_row_scale_masks_whole_rows() -> None:
    trajs = trajectories(4, seed=1)
    [batch] = pack(trajs, 1000, row_scale_B=torch.tensor([1.0, 0.0, 1.0, 1.0]))
    mask = batch.gather([mb.loss_mask_T for mb in batch.micro_batches])
    assert float(mask[1].sum()) == 0.0
    assert batch.num_loss_tokens == sum(sum(t.loss_mask) for i, t in enumerate(trajs) if i != 1)
    assert batch.num_loss_sequences == 3
    for bad in (torch.tensor([1.0, 0.5, 1.0, 1.0]), torch.ones(3)):  # a fraction; one value short
        with pytest.raises(ValueError, match="one 0 or 1 per trajectory"):
            pack(trajs, 1000, row_scale_B=bad)


def test_pack_rejects_empty_prompt() -> None:
    with pytest.raises(ValueError, match="no prompt tokens"):
        pack([_traj([], [Segment("model", [1], [-1.0])])], 10)
