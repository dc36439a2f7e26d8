"""The front ends: kvrouter's own HTTP server, its native endpoints, the FastAPI app, the OpenAPI spec."""
