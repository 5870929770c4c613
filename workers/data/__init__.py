"""JSONL training rows (parsed with api/'s row rules), image inputs, and sampling: which examples each rank trains on,
step by step, so a resumed run sees the same order."""
