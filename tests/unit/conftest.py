"""Unit tests are fast and pure (or drive vLLM's classes without a server). Which of them every engine
lane runs is decided with the rest of the lane marking, in ``tests/suites.py`` (``NO_VLLM``)."""
