"""Transport with no knowledge of routing: the upstream client, sockets, ASGI types, bodies, SSE."""
