"""kvrouter index: KV event decoding, block keys, the reference-counted prefix store and the ZMQ subscriber. Knows nothing of HTTP."""
