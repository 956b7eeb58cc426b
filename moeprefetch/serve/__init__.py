"""`moeprefetch serve`: an OpenAI-compatible HTTP server over one engine (optional extra `.[serve]`).

- `protocol.py`: the OpenAI request bodies, validated into `Job`s, and OpenAI-style error bodies;
- `scheduler.py`: the one thread that drives the engine: a bounded queue, continuous batching at token boundaries
  (`batching.ContinuousBatch`), stop strings, cancellation, per-request failures, draining;
- `app.py`: the Starlette application (completions, chat completions, models, health, Prometheus metrics, SSE).
"""
