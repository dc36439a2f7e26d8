"""The front ends: uvicorn with kvrouter's client limits, the ASGI app, its native endpoints, the
FastAPI app, the OpenAPI spec."""
