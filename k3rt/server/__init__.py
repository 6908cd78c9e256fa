"""The OpenAI-compatible HTTP edge of `k3rt serve`.

app.py (routes) -> chat.py / completions.py (OpenAI request -> gateway job, gateway deltas -> OpenAI
responses and SSE chunks) -> `k3rt.backend.gateway.Gateway` (tokenize, detokenize, stop strings, engine
requests) -> the engine process. schemas.py parses request bodies, errors.py shapes every error as
OpenAI's error object, tools.py renders and parses tool calls, metrics.py is the Prometheus side,
launch.py runs the whole thing (uvloop + uvicorn) and owns shutdown.

Importing this package needs fastapi and pydantic but never torch; engine code is reached only through
the gateway, which is imported where the server is built.
"""
