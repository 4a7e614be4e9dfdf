"""The model server: an OpenAI-compatible API over the engine, with routing, limits, metrics and tracing."""
