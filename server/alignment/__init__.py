"""Per-request chunk alignment: steps that carry image tokens never need CUDA-graph padding.

- :mod:`server.alignment.capture`: capture sizes and the rounding helpers;
- :mod:`server.alignment.plan`: the pure decision (what to change in one step);
- :mod:`server.alignment.scheduler`: vLLM's scheduler with the decision applied (``--scheduler-cls``).
"""

#: What vlguard passes as vLLM's ``--scheduler-cls`` when alignment is on.
SCHEDULER_CLS = "server.alignment.scheduler.AlignedScheduler"
#: Largest capture size to align to when the engine itself pads nothing (CPU, padding emulation in tests).
MAX_CAPTURE_ENV = "VLGUARD_ALIGNMENT_MAX_CAPTURE_SIZE"
