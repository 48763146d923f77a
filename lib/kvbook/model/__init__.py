"""The model: what a forward pass computes (norm, rope, attention, mlp, linear, the Qwen3 decoder in qwen3.py), its
weights (weights.py) and their int8 form (quant.py). Nothing here knows how requests are scheduled."""
