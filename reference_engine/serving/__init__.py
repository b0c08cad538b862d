"""Serving: the OpenAI-compatible HTTP server, its protocol, Prometheus metrics and the
async wrapper that runs the engine on its own thread. Imports runtime and models."""
