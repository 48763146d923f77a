"""The KV cache: contiguous (contiguous.py), paged with a block pool and prefix hashing (paged.py), quantized storage
(kv_quant.py), and the one formula of its memory (memory.py)."""
