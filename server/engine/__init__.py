"""What vlguard runs inside vLLM's engine processes (the engine core and its workers), loaded there by
vLLM's plugin entry points (``vlguard_fatal``, ``vlguard_parent_watch``) and by the ``boot`` folder put
on their ``PYTHONPATH``; the spare process is spawned by the API process and becomes an engine process.

- :mod:`.protocol`: the contract with the API process (environment, state directory, records, request
  ids); besides it the API process uses :mod:`.spare` (it spawns the spare) and one traceback helper
  of :mod:`.fatal`;
- :mod:`.fatal`: the step log, who the failing code was handling, the fatal record before a death;
- :mod:`.soft`: soft recovery (absorb a step's fault, keep the process);
- :mod:`.spare`: a spare process and the hand-over inside vLLM's start-up code;
- :mod:`.parent_watch` (+ ``boot/``): engine processes end when vlguard ends.

Nothing here imports :mod:`server.guard` or :mod:`server.api`.
"""
