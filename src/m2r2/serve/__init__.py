"""``m2r2 serve``: an OpenAI-compatible HTTP server with continuous batching (see :mod:`m2r2.serve.app`)."""
