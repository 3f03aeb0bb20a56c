"""agentrl: reinforcement learning for LLM agents that use tools while they reason.

The data flow: task.py (prompts, in prompt_order.py's order) -> rollout.py (engine/ + tools/) -> rewards/
-> batch.py (algo/: advantages) -> learn.py (learner/: the updates) -> weight_sync.py (the new weights back
into the engines), driven by trainer.py's loop, placed by placement.py, built by build.py. Heavy
dependencies (torch, transformers) are imported by the stages that need them, never here, so
`agentrl --help` stays instant.
"""

__version__ = "0.1.0"
