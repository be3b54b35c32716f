"""HTTP surface: vlguard's own routes (health, readiness, version, metrics), dependencies and the
exception-to-OpenAI-envelope map. The OpenAI routes themselves are vLLM's own routers."""
