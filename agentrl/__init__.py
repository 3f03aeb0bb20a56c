"""agentrl: reinforcement learning for LLM agents that use tools while they reason.

The data flow (DESIGN.md): task.py -> rollout.py (engine/ + tools/) -> rewards/ -> algo/ -> learner/
-> weight_sync.py -> engine/. Heavy dependencies (torch, transformers) are imported by the stages that
need them, never here, so `agentrl --help` stays instant.
"""

__version__ = "0.1.0"
