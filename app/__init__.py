"""specserve engine: exact speculative decoding in plain Python + torch + transformers (no Ray)."""
