"""The engine guard: the supervisor that owns the vLLM ``AsyncLLM`` and the engine client the
OpenAI serving layer talks to."""
