"""`moeprefetch serve`: an OpenAI-compatible HTTP server over one engine (optional extra `.[serve]`).

- `protocol.py`: the OpenAI request bodies, validated into `Job`s, and OpenAI-style error bodies;
- `scheduler.py`: the one thread that drives the engine: a bounded queue, continuous batching at token boundaries
  (`batching.ContinuousBatch`), stop strings, cancellation, per-request failures, draining;
- `guards.py`: what a request passes first: Host header, API key, drain, and a body's type, size and read timeout;
- `app.py`: the Starlette application (completions, chat completions, models, health, Prometheus metrics, SSE);
- `lifecycle.py`: uvicorn's server with the drain first (503s while draining, a second signal exits cleanly).
"""
