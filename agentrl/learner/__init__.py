"""The learner: packed batches in, updated weights out, over FSDP2 on GPUs or CPU ranks.

packing.py builds the tensors from trajectories (the one place); attention.py keeps attention inside each
packed sequence; logprobs.py computes per-token logprobs chunk by chunk; fsdp.py shards; worker.py runs
micro-batches and optimizer steps for the roles in policy.py, critic.py and reference.py; checkpoint.py
saves, resumes and exports; optim.py holds AdamW and its schedule; config.py the settings.
"""
