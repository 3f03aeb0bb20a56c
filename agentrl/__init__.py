"""agentrl: reinforcement learning for LLM agents that use tools while they reason.

The data flow: task.py -> rollout.py (engine/ + tools/) -> rewards/ -> algo/ -> learner/, whose updated
weights go back to the engines (`Engine.update_weights`). Heavy dependencies (torch, transformers) are imported by the stages that
need them, never here, so `agentrl --help` stays instant.
"""

__version__ = "0.1.0"
