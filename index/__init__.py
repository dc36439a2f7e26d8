"""kvrouter index: KV event decoding, block keys, the reference-counted prefix store, the subscriber.

Knows nothing of HTTP; the router uses it through :class:`index.kvindex.KVIndex`. The store and the
fused event ingest are compiled C (``index/_kvcore.c``), built at install time.
"""
