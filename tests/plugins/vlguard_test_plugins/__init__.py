"""Test-only vLLM plugins: CUDA-graph padding emulation and fault injection on CPU."""
