"""Verification rules as pure tensor functions: the one logits -> probabilities transform
(sampling), the exact, nucleus, typical and engine rules with their exact deviation (verify,
lossy), and the same rules on vLLM's ragged batches (ragged)."""
