"""Small, offline, seeded pieces for runs on a CPU: a tiny tokenizer (tokenizer.py)."""
