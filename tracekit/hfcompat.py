"""What differs between the transformers versions tracekit runs on (4.48 to 5.2x).

One home for the shims that the engine and the diagnostic both need; torch and
transformers are imported lazily by the callers that pass a model in.
"""

from __future__ import annotations

import inspect
from typing import Any


def cache_keyword(model: Any) -> str:
    """The forward keyword of the KV cache: transformers 5.2x renamed
    `past_key_values` to `cache` (the old name still works, with a warning)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def new_dynamic_cache(model: Any):
    """An empty DynamicCache for `model` (older signatures take no config)."""
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:
        return DynamicCache()
