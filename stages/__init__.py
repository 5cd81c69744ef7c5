"""lifecycle-serve: an LLM inference server built as a Ray Serve deployment graph."""
