"""Where transformers' API moved between the versions this project accepts (pyproject: >= 4.56).

The KV cache keyword of a model's forward: `past_key_values` up to 5.2x, `cache` since, with
`past_key_values` deprecated (a warning on every call) and removed in 5.40. Once removed, a forward
would take the old keyword into its **kwargs and ignore it: no error, no cache, wrong logits. So
every forward that passes a cache names it by what the model's own signature takes.
"""

import functools
import inspect


@functools.lru_cache(maxsize=64)
def _cache_keyword(forward_owner: type) -> str:
    return "cache" if "cache" in inspect.signature(forward_owner.forward).parameters else "past_key_values"


def with_cache(model, cache) -> dict:
    """The keyword argument that gives `model`'s forward a KV cache."""
    return {_cache_keyword(type(model)): cache}


def returned_cache(out):
    """The KV cache a forward returned, under either name."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values
