"""The HTTP path: kvrouter's own server, the proxy hot path, the upstream client, errors."""
