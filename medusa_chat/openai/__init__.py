"""An OpenAI-compatible HTTP server: request parsing, routes with SSE streaming, the server and its CLI."""
