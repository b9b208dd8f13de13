"""The OpenAI-compatible HTTP API: a second thin front end over the same engine."""
