"""kvrouter index: KV event decoding, block keys, the reference-counted prefix store, the subscriber.

Knows nothing of HTTP; the router uses it through :class:`index.kvindex.KVIndex`.
"""

from index._jit import ensure_cache_dir

ensure_cache_dir()  # before any submodule imports numba (see index/_jit.py)
