"""A model and its forwards: the runner, batches and attention over the paged KV cache, its budget, the CPU kernels, compiled steps, loading and where models come from."""
