"""A reward function for the example task examples/units.yaml."""

import re


def close_enough(response, ground_truth, tool_calls, tolerance=0.01):
    """1 when the last number the model wrote is within `tolerance` (relative) of the answer, else 0; the
    parts say whether it was right and whether it used the tool without an error."""
    numbers = re.findall(r"-?\d+(?:\.\d+)?", response)
    gold = float(ground_truth)
    correct = bool(numbers) and abs(float(numbers[-1]) - gold) <= tolerance * max(abs(gold), 1e-9)
    used = any(call["name"] == "convert" and call["error"] is None for call in tool_calls)
    return {"score": float(correct), "correct": float(correct), "used_tool": float(used)}
