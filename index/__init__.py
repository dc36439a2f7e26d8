"""kvrouter index: KV event decoding, block keys, the reference-counted prefix store, the subscriber.

Knows nothing of HTTP; the router uses it through :class:`index.kvindex.KVIndex`.
"""
