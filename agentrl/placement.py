"""Where the learner and the rollout engines run, decided once (`place`): in this process, or as Ray
actors (ray_placement.py). The trainer gets the same interface either way and never asks which.

    one process: learn.Learner (the policy, and the reference and critic where needed) and the engine
        build.py makes: transformers on engine.device, or vLLM on this GPU (in a child process of its own
        unless engine.own_process is off)
    Ray: RayLearner over `placement.learner_ranks` ranks, and `placement.engines` RayEngines pooled behind
        engine/pool.py's EnginePool (a trajectory's turns stick to one engine)

On Ray all actors sit in one placement group (ray_placement.Layout says which bundle holds what), by
`placement.mode`:
- colocated (vLLM engines): engine i shares learner rank i's GPU (half of its bundle each in Ray's
  accounting) and sleeps while the learner trains (`RunConfig.engine_sleeps`, as a colocated vLLM engine in one
  process does); the weights reach it by CUDA IPC.
- split (vLLM engines): engines on GPUs of their own, which never hold learner state; weights go by NCCL
  broadcast from rank 0 to every engine worker.
- transformers engines: weights as safetensors bytes from rank 0 to every engine.
weight_sync.py moves the weights in each case. With `services.on_ray` the auto services run in actors too
(services.RayService), spread over the nodes.

A checkpoint is the one-process run's format (the sharded part is torch.distributed.checkpoint, loadable
on another number of ranks), so either kind of run resumes the other's.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from agentrl.build import build_engine, build_lm, engine_model_dir
from agentrl.learn import Learner
from agentrl.run_config import RunConfig
from agentrl.weight_sync import transport


def place(config: RunConfig, run_root: Path, tokenizer: Any, engine: Any = None) -> tuple[Any, Any, Any]:
    """(learner, engine, placement) for the run: `engine` where the caller brings one (tests), else built;
    placement is None in one process."""
    seed = config.trainer.seed
    if not config.placement.on_ray:
        lm = build_lm(config)
        if engine is None and config.engine.kind == "vllm":
            # vLLM sizes its memory from what is free when it starts: before the learner takes its share
            engine = build_engine(config, seed=seed, model_dir=engine_model_dir(config, run_root, tokenizer, lm))
        engine_lm = copy.deepcopy(lm) if engine is None else None  # before the learner wraps its own copy
        learner = Learner(config, lm)
        if engine is None:
            engine = build_engine(config, seed=seed, lm=engine_lm, tokenizer=tokenizer)
        return learner, engine, None
    from agentrl.engine.pool import EnginePool
    from agentrl.ray_placement import Placement, RayLearner, ray_engines

    placement = Placement(config)
    model_dir = engine_model_dir(config, run_root, tokenizer) if config.engine.kind == "vllm" else None
    engines = ray_engines(config, placement, model_dir)  # first: vLLM sizes its memory from what is free
    learner = RayLearner(config, placement)
    if transport(config) == "nccl":  # split vLLM engines receive full weights by broadcast
        learner.join(engines)
    return learner, engine or EnginePool(engines), placement
