"""Trajectories -> packed micro-batches: the one place the learner's tensors are built.

Each trajectory becomes one sequence, prompt ids then response ids, laid end to end with other sequences in
a micro-batch of at most `token_budget` tokens (a longer sequence gets a micro-batch of its own) with no
padding: position ids restart at 0 for every sequence and `cu_seqlens` marks where each starts, which the
packed attention (attention.py) uses to keep attention inside a sequence. Per-token tensors are aligned to
the position that *predicts* the token: position t carries target ids[t+1], its loss mask (from
`Trajectory.loss_mask`, the one place the mask is built) and the engine's logprob of it; a sequence's last
position predicts nothing.

Sequences are spread over data-parallel ranks balanced by token count, then first-fit-decreasing into
micro-batches; every rank gets the same number of micro-batches (FSDP's collectives need that), adding a
one-token empty micro-batch where a rank runs short. Normalisers of the loss (`num_loss_tokens`,
`num_loss_sequences`) are those of the whole batch across ranks, so per-micro-batch sums add up exactly.

The trainer computes advantages in the response layout, [B, R] (row = trajectory, column = response token;
`response_layout`), and moves tensors between the two layouts with `Batch.set` and `Batch.gather`.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from agentrl.types import Trajectory

TokenField = Literal["advantages", "old_logprobs", "ref_logprobs", "returns", "old_values"]


@dataclass
class MicroBatch:
    """S sequences, T tokens in all, on one rank. Fields ending in _T have one entry per token."""

    input_ids_T: Tensor  # long
    position_ids_T: Tensor  # long, restarting at 0 per sequence
    target_ids_T: Tensor  # long: the next token of the same sequence; 0 where there is none
    loss_mask_T: Tensor  # float: 1 where the target is a model-sampled token (times the row's scale)
    engine_logprobs_T: Tensor  # float: the engine's logprob of the target (0 off the response)
    seq_index_T: Tensor  # long: which of the S sequences the token belongs to
    response_index_T: Tensor  # long: row * R + column of the target in the response layout; -1 if none
    cu_seqlens_S: Tensor  # int32, S + 1 entries
    max_seqlen: int
    rows: list[int]  # the trajectory (row of the response layout) of each sequence; -1 for filler
    advantages_T: Tensor | None = None
    old_logprobs_T: Tensor | None = None
    ref_logprobs_T: Tensor | None = None
    returns_T: Tensor | None = None
    old_values_T: Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids_T.shape[0])

    def to(self, device: torch.device | str) -> MicroBatch:
        """This micro-batch on `device`. Host tensors bound for a GPU go through pinned memory, so the copy
        is truly asynchronous: a copy from pageable memory would wait for the GPU's queue to drain first."""
        device = torch.device(device)
        pin = device.type == "cuda"

        def move(v: Tensor) -> Tensor:
            if pin and v.device.type == "cpu":
                v = v.pin_memory()
            return v.to(device, non_blocking=True)

        tensors = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return dataclasses.replace(self, **{k: move(v) for k, v in tensors.items() if isinstance(v, Tensor)})


@dataclass
class Batch:
    """One rank's micro-batches of a batch of `num_rows` trajectories, with the batch-wide counts."""

    micro_batches: list[MicroBatch]
    num_rows: int  # B: trajectories in the whole batch (all ranks)
    max_response_len: int  # R: columns of the response layout
    num_loss_tokens: int  # sampled tokens in the whole batch (after row scales)
    num_loss_sequences: int  # trajectories with at least one such token
    rank: int = 0
    world_size: int = 1

    @property
    def num_tokens(self) -> int:
        return sum(mb.num_tokens for mb in self.micro_batches)

    def scatter(self, values_BR: Tensor) -> list[Tensor]:
        """A response-layout tensor -> one per-token tensor per micro-batch (0 where no response token)."""
        flat = values_BR.reshape(-1).to(torch.float32)
        out = []
        for mb in self.micro_batches:
            index_T = mb.response_index_T
            valid_T = index_T >= 0
            values_T = torch.zeros(mb.num_tokens, dtype=torch.float32)
            values_T[valid_T] = flat[index_T[valid_T]]
            out.append(values_T)
        return out

    def set(self, name: TokenField, values_BR: Tensor) -> None:
        """Attach a response-layout tensor (advantages, old logprobs, ...) to the micro-batches."""
        if tuple(values_BR.shape) != (self.num_rows, self.max_response_len):
            raise ValueError(f"{name}: expected shape {(self.num_rows, self.max_response_len)}, got {tuple(values_BR.shape)}")
        for mb, values_T in zip(self.micro_batches, self.scatter(values_BR), strict=True):
            setattr(mb, f"{name}_T", values_T)

    def gather(self, values_per_micro_batch: Sequence[Tensor]) -> Tensor:
        """Per-token tensors (one per micro-batch, aligned like the targets) -> the response layout [B, R].
        Rows held by other ranks stay 0: summing the ranks' results gives the whole batch."""
        out = torch.zeros(self.num_rows * self.max_response_len, dtype=torch.float32)
        for mb, values_T in zip(self.micro_batches, values_per_micro_batch, strict=True):
            index_T = mb.response_index_T
            valid_T = index_T >= 0
            out[index_T[valid_T]] = values_T.detach().to("cpu", torch.float32)[valid_T]
        return out.view(self.num_rows, self.max_response_len)


@dataclass
class ResponseLayout:
    """The [B, R] view the advantage functions read (agentrl/algo/advantage.py)."""

    mask_BR: Tensor  # float: Trajectory.loss_mask, 0-padded
    engine_logprobs_BR: Tensor
    response_lens_B: Tensor  # long: response tokens (model and tool) per trajectory


def response_layout(trajectories: Sequence[Trajectory]) -> ResponseLayout:
    width = max((len(t.response_ids) for t in trajectories), default=0)
    mask_BR = torch.zeros(len(trajectories), width)
    logprobs_BR = torch.zeros(len(trajectories), width)
    for b, t in enumerate(trajectories):
        n = len(t.response_ids)
        mask_BR[b, :n] = torch.tensor(t.loss_mask, dtype=torch.float32)
        logprobs_BR[b, :n] = torch.tensor(t.response_logprobs, dtype=torch.float32)
    lens_B = torch.tensor([len(t.response_ids) for t in trajectories], dtype=torch.long)
    return ResponseLayout(mask_BR, logprobs_BR, lens_B)


def pack(
    trajectories: Sequence[Trajectory],
    token_budget: int,
    world_size: int = 1,
    row_scale_B: Tensor | None = None,
) -> list[Batch]:
    """Pack `trajectories` for `world_size` data-parallel ranks; returns one `Batch` per rank.
    `row_scale_B` keeps (1) or drops (0) whole rows of the loss mask (e.g. sampling.keep_untruncated); other
    values are refused: the per-sequence loss aggregations count a row's tokens, which a fraction would not
    scale."""
    if not trajectories:
        raise ValueError("pack: no trajectories")
    if row_scale_B is not None and (tuple(row_scale_B.shape) != (len(trajectories),)
                                    or not bool(((row_scale_B == 0) | (row_scale_B == 1)).all())):
        raise ValueError(f"pack: row_scale_B must hold one 0 or 1 per trajectory ({len(trajectories)}), "
                         f"got shape {tuple(row_scale_B.shape)} with values {sorted(set(row_scale_B.flatten().tolist()))[:5]}")
    lengths = [len(t.prompt.token_ids) + len(t.response_ids) for t in trajectories]
    if any(not t.prompt.token_ids for t in trajectories):
        raise ValueError("pack: a trajectory has no prompt tokens (its first response token has no context)")
    scale_B = torch.ones(len(trajectories)) if row_scale_B is None else row_scale_B.to(torch.float32)
    width = max(len(t.response_ids) for t in trajectories)
    loss_tokens_B = torch.tensor([sum(t.loss_mask) for t in trajectories], dtype=torch.float32) * scale_B
    bins_per_rank = [_first_fit_decreasing(rows, lengths, token_budget) for rows in _balance(lengths, world_size)]
    count = max(len(bins) for bins in bins_per_rank)
    batches = []
    for rank, bins in enumerate(bins_per_rank):
        bins = _split_to(bins, count, lengths)
        micro = [_build(trajectories, rows, width, scale_B) for rows in bins]
        batches.append(
            Batch(micro, len(trajectories), width, int(loss_tokens_B.sum().round()), int((loss_tokens_B > 0).sum()),
                  rank, world_size)
        )
    return batches


def _balance(lengths: list[int], world_size: int) -> list[list[int]]:
    """Longest-processing-time assignment of rows to ranks by token count (deterministic)."""
    heap = [(0, r) for r in range(world_size)]
    ranks: list[list[int]] = [[] for _ in range(world_size)]
    for row in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        load, r = heapq.heappop(heap)
        ranks[r].append(row)
        heapq.heappush(heap, (load + lengths[row], r))
    return ranks


def _first_fit_decreasing(rows: list[int], lengths: list[int], budget: int) -> list[list[int]]:
    bins: list[list[int]] = []
    loads: list[int] = []
    for row in sorted(rows, key=lambda i: (-lengths[i], i)):
        for i, load in enumerate(loads):
            if load + lengths[row] <= budget:
                bins[i].append(row)
                loads[i] += lengths[row]
                break
        else:
            bins.append([row])
            loads.append(lengths[row])
    return bins


def _split_to(bins: list[list[int]], count: int, lengths: list[int]) -> list[list[int]]:
    """Split the fullest multi-sequence bins until there are `count`; pad with empty bins if none can split."""
    bins = [list(b) for b in bins]
    while len(bins) < count:
        splittable = [b for b in bins if len(b) > 1]
        if not splittable:
            bins.append([])
            continue
        biggest = max(splittable, key=lambda b: sum(lengths[i] for i in b))
        bins.remove(biggest)
        bins += [biggest[0::2], biggest[1::2]]
    return sorted(bins, key=lambda b: -sum(lengths[i] for i in b))


def _build(trajectories: Sequence[Trajectory], rows: list[int], width: int, scale_B: Tensor) -> MicroBatch:
    """Concatenate the sequences of `rows` (an empty list gives a one-token filler micro-batch)."""
    ids: list[int] = []
    positions: list[int] = []
    targets: list[int] = []
    mask: list[float] = []
    engine: list[float] = []
    seq_index: list[int] = []
    response_index: list[int] = []
    cu = [0]
    for s, row in enumerate(rows):
        t = trajectories[row]
        prompt, response = list(t.prompt.token_ids), t.response_ids
        seq = prompt + response
        n, p = len(seq), len(prompt)
        scale = float(scale_B[row])
        ids += seq
        positions += range(n)
        targets += seq[1:] + [0]
        pad = [0.0] * (p - 1)
        mask += pad + [m * scale for m in t.loss_mask] + [0.0]
        engine += pad + t.response_logprobs + [0.0]
        seq_index += [s] * n
        response_index += [-1] * (p - 1) + [row * width + j for j in range(len(response))] + [-1]
        cu.append(cu[-1] + n)
    if not rows:
        ids, positions, targets, mask, engine, seq_index, response_index, cu = [0], [0], [0], [0.0], [0.0], [0], [-1], [0, 1]
    return MicroBatch(
        input_ids_T=torch.tensor(ids, dtype=torch.long),
        position_ids_T=torch.tensor(positions, dtype=torch.long),
        target_ids_T=torch.tensor(targets, dtype=torch.long),
        loss_mask_T=torch.tensor(mask, dtype=torch.float32),
        engine_logprobs_T=torch.tensor(engine, dtype=torch.float32),
        seq_index_T=torch.tensor(seq_index, dtype=torch.long),
        response_index_T=torch.tensor(response_index, dtype=torch.long),
        cu_seqlens_S=torch.tensor(cu, dtype=torch.int32),
        max_seqlen=max(b - a for a, b in zip(cu[:-1], cu[1:], strict=True)),
        rows=list(rows) if rows else [-1],
    )
