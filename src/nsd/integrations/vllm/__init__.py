"""nsd as a vLLM plugin (see plugin.py)."""
