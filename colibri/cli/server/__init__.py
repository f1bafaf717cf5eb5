"""`colibri serve`: an OpenAI-compatible HTTP server on the batch engine."""
