"""The engine guard, in the API process: it owns vLLM's ``AsyncLLM`` and answers for every request.

- :mod:`.supervisor`: engine states, admission (hold while the engine is away), the restart budget, the
  watch loop, the decision to rebuild, shutdown;
- :mod:`.lifecycle`: how an engine is built, shares the serving renderer, and is torn down;
- :mod:`.accounting`: what a fault costs and whom (strikes, client faults, suspects, soft-recovery cuts);
- :mod:`.engine_client`: the engine client vLLM's serving classes use: replay, resume and re-run across
  recoveries (:mod:`.rerun`), probation (:mod:`.inflight`), the processed-image cache per engine core
  (:mod:`.ipc_cache`), output-processing faults (:mod:`.output_faults`);
- :mod:`.quarantine`, :mod:`.clients`: fingerprints and clients refused;
- :mod:`.watchdog`: process and progress checks; :mod:`.spare`: keeps a spare engine process ready;
  :mod:`.systemd`: service notifications; :mod:`.errors`: the guard's exceptions and their HTTP status.

What runs inside vLLM's engine processes is :mod:`server.engine`; what touches vLLM's internals is
:mod:`server.vllm_hooks`.
"""
