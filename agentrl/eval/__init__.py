"""Evaluation: a model's answers on held-out problems, through the same rollout loop, tool format and reward
as training (not speed: bench/ and BENCHMARKS.md measure that).

evaluate.py samples `n` trajectories per prompt, scores them and turns the per-sample records into metrics
(pass@1, the unbiased pass@k, maj@k, tool use, turns, stop reasons); the trainer's validation calls it
directly. datasets.py holds the evaluation datasets by name (math500, aime24, gsm8k, nq, ...): where each
one's rows are, local file or hub copy, and how its answers are read and graded, as a task spec's `dataset`
section. run.py is `agentrl eval`: each named dataset through evaluate.py, with its records, results.json
and results.md in one output directory, resumable.
"""
