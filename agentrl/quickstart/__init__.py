"""The quickstart's offline, seeded pieces: word problems for the code tool (arithmetic.py), fictional
people, their corpus and questions for the search tool (entities.py), BPE tokenizers learned from text
(tokenizer.py), and `python -m agentrl.quickstart prepare | table` (__main__.py)."""


def trace(id_: str, prompt: str, *texts: str) -> dict:
    """An SFT trace in the trainer's dump format; `texts` alternate the model's and a tool's: model, tool,
    model, ..."""
    segments = [{"source": "tool" if i % 2 else "model", "text": t} for i, t in enumerate(texts)]
    return {"id": id_, "prompt": prompt, "segments": segments}
