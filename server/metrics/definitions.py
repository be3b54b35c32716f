"""Every ``vlguard_*`` metric, defined once (name, type, labels, help, buckets).

Imported lazily by whichever process records a metric: the API process (guard, patches), the engine
core (alignment) and the workers (deepstack buffer). Under ``PROMETHEUS_MULTIPROC_DIR`` each process
writes its own files and ``/metrics`` aggregates them; gauges declare how to combine processes.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
_RATIO_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)

# -- patches (every process) --------------------------------------------------------------------------
PATCH_ACTIVE = Gauge(
    "vlguard_patch_active",
    "1 when a vlguard backport is active for the installed vLLM, 0 when it is not needed or disabled.",
    ["patch", "vllm_version"],
    multiprocess_mode="mostrecent",
)

# -- deepstack buffer (worker processes) --------------------------------------------------------------
DEEPSTACK_CAPACITY = Gauge(
    "vlguard_deepstack_buffer_capacity_tokens",
    "Rows (tokens) the deepstack buffer can hold per level.",
    multiprocess_mode="mostrecent",
)
DEEPSTACK_WRITTEN = Histogram(
    "vlguard_deepstack_written_tokens",
    "Deepstack rows written per step that carries image or video tokens.",
    buckets=_TOKEN_BUCKETS,
)
DEEPSTACK_OCCUPANCY = Histogram(
    "vlguard_deepstack_occupancy_ratio",
    "Written rows / buffer capacity, per step that carries image or video tokens.",
    buckets=_RATIO_BUCKETS,
)
DEEPSTACK_PADDED_READS = Counter(
    "vlguard_deepstack_padded_reads",
    "Deepstack reads past the written rows (CUDA-graph padding); each one is a crash on stock vLLM 0.20.0.",
)
DEEPSTACK_PADDING = Counter(
    "vlguard_deepstack_padding_tokens",
    "Zero rows served past the written rows by padded deepstack reads.",
)

# -- chunk alignment (engine-core process) -------------------------------------------------------------
ALIGNMENT_STEPS = Counter(
    "vlguard_alignment_steps",
    "Steps that carry image or video tokens, by what alignment did (aligned, filled, trimmed, unaligned).",
    ["outcome"],
)
ALIGNMENT_RECOMPUTED = Counter(
    "vlguard_alignment_recomputed_tokens",
    "Tokens recomputed because alignment shortened a prefix-cache hit to fill a step.",
)
ALIGNMENT_DEFERRED = Counter(
    "vlguard_alignment_deferred_tokens",
    "Tokens alignment moved from a step to the next one by trimming a chunk.",
)

# -- engine guard (API process) -----------------------------------------------------------------------
ENGINE_UP = Gauge("vlguard_engine_up", "1 while the engine is READY, else 0.", multiprocess_mode="mostrecent")
ENGINE_STATE = Gauge(
    "vlguard_engine_state",
    "1 for the supervisor's current state (starting, ready, dead, restarting, failed, stopped), 0 for the others.",
    ["state"],
    multiprocess_mode="mostrecent",
)
RESTART_BUDGET = Gauge(
    "vlguard_engine_restart_budget",
    "In-process engine restarts allowed per restart window (--guard-restart-max); one more exits the process.",
    multiprocess_mode="mostrecent",
)
ENGINE_DEATHS = Counter(
    "vlguard_engine_deaths",
    "Engine faults, by cause (deepstack, process_exit, hang, exception), whether recovered softly or by a rebuild.",
    ["cause"],
)
ENGINE_PROBES = Counter(
    "vlguard_engine_probes",
    "vlguard's own one-token requests to the engine (readiness and liveness probes), by result (ok, failed); "
    "kept out of vLLM's client series (vllm:request_success_total, token counters, latency histograms).",
    ["result"],
)
ENGINE_RESTARTS = Counter(
    "vlguard_engine_restarts", "In-process engine restart attempts, by outcome (success, failure).", ["outcome"]
)
RESTART_DURATION = Histogram(
    "vlguard_engine_restart_duration_seconds",
    "From the engine's death to the new engine READY.",
    buckets=(1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200),
)
ENGINE_RECOVERIES = Counter(
    "vlguard_engine_recoveries",
    "Engine faults recovered, by kind (soft: absorbed inside the live engine; rebuild: a new engine built).",
    ["kind"],
)
RECOVERY_DURATION = Histogram(
    "vlguard_engine_recovery_duration_seconds",
    "From an engine fault to the engine accepting work again, by kind (soft, rebuild).",
    ["kind"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600, 1200),
)
# A gauge of what each API process holds is summed over the live ones (``--api-server-count N``).
REQUESTS_HELD = Gauge(
    "vlguard_requests_held", "Requests waiting for the engine to become READY.", multiprocess_mode="livesum"
)
REQUESTS_INFLIGHT = Gauge("vlguard_requests_inflight", "Requests inside the engine now.", multiprocess_mode="livesum")
REQUESTS_REPLAYED = Counter(
    "vlguard_requests_replayed", "Requests re-submitted from scratch to a new engine after a death."
)
REQUESTS_RESUMED = Counter(
    "vlguard_requests_resumed", "Streams continued on a new engine from the tokens already sent."
)
MM_CACHE_RESENDS = Counter(
    "vlguard_mm_cache_resends",
    "Requests sent again with their image data after the engine core missed an item the guard had "
    "stripped (its processor cache drifted from the guard's shadow of it).",
)
REQUESTS_FAILED = Counter(
    "vlguard_requests_failed",
    "Requests the guard could not save, by reason (hold_timeout, too_many_held, engine_failed, "
    "not_resumable, rerun_diverged, replay_limit).",
    ["reason"],
)
API_TASKS = Gauge(
    "vlguard_api_event_loop_tasks",
    "asyncio tasks alive in the API process (sampled at each scrape); a leak only grows.",
    multiprocess_mode="livesum",
)
REQUESTS_REJECTED = Counter(
    "vlguard_requests_rejected",
    "Requests refused at the door, by reason (media, body, body_too_large, overload, client_faults, poison, memory, "
    "client_memory, route; under load: saturated, deadline, client_share, queued_reqs, queued_tokens).",
    ["reason"],
)
# -- load (API process) -------------------------------------------------------------------------------
QUEUE_EXPECTED_WAIT = Gauge(
    "vlguard_queue_expected_wait_seconds",
    "Seconds a generation request arriving now can expect to wait before its prefill ends (admission's "
    "estimate, sampled at each admission; vLLM's own vllm:request_queue_time_seconds measures the wait).",
    multiprocess_mode="max",
)
REQUESTS_CANCELLED = Counter(
    "vlguard_requests_cancelled",
    "Requests ended before their answer because their caller went (disconnect) or their deadline passed "
    "(deadline: X-Request-Timeout), wherever they were (held, queued, running or streaming).",
    ["reason"],
)
ABORTED_TOKENS = Counter(
    "vlguard_aborted_tokens",
    "Tokens the engine generated for requests that ended without finishing (their caller went, their "
    "deadline passed, the engine died under them): work spent for nobody.",
)
REQUESTS_QUARANTINED = Counter(
    "vlguard_requests_quarantined", "Requests refused because their fingerprint is quarantined."
)
QUARANTINE_STRIKES = Counter(
    "vlguard_quarantine_strikes",
    "Strikes the quarantine charged to requests, by evidence (named: the failing code was handling the "
    "request; step_exception: the request was in the step whose execution raised). Kills, crashes and "
    "hangs charge nobody.",
    ["evidence"],
)
BODY_BYTES = Gauge(
    "vlguard_request_body_bytes",
    "Bytes of the request bodies inside the API process now (bounded by --guard-max-body-memory-mb).",
    multiprocess_mode="livesum",
)
BODY_GC_COLLECTIONS = Counter(
    "vlguard_body_gc_collections",
    "Full garbage collections run because finished request bodies reached a quarter of "
    "--guard-max-body-memory-mb (a parsed body outlives its request in a reference cycle until one runs).",
)
DECODE_PIXELS = Gauge(
    "vlguard_decode_pixels",
    "Pixels of the images being normalised now (bounded by --guard-decode-pixels).",
    multiprocess_mode="livesum",
)
DECODE_WAITING = Gauge(
    "vlguard_decode_waiting",
    "Images waiting to be normalised (for their client's turn or the decode pool's pixel budget).",
    multiprocess_mode="livesum",
)
IMAGE_CACHE_LOADS = Counter(
    "vlguard_image_cache_loads",
    "Images vLLM loaded through vlguard's decoded-image cache: hit (a copy of the pixels decoded for the same "
    "bytes before), miss (decoded; kept if it fits) or skipped (decoded, not cacheable: off, too large, per-request "
    "decode state).",
    ["result"],
)
IMAGE_CACHE_BYTES = Gauge(
    "vlguard_image_cache_bytes",
    "Bytes of decoded images kept for images sent again (bounded by --guard-image-cache-mb).",
    multiprocess_mode="livesum",
)
CLIENT_FAULTS = Counter(
    "vlguard_client_faults",
    "Engine faults charged to one client's request with certainty (the fault named that request alone); "
    "they count against the client's fault budget, not the engine's soft-recovery or restart budgets.",
)
CLIENTS_REFUSED = Gauge(
    "vlguard_clients_refused",
    "Clients refused now (429) because their requests caused too many engine faults (--guard-client-fault-max).",
    multiprocess_mode="mostrecent",
)
SPARE_UP = Gauge(
    "vlguard_engine_spare_up",
    "1 while a spare engine-core process (imported, waiting for a rebuild) is alive, else 0.",
    multiprocess_mode="mostrecent",
)
REBUILD_PATH = Gauge(
    "vlguard_engine_rebuild_path",
    "1 for the path a rebuild would take now: spare (a spare engine process imported and waiting), "
    "spare_starting (a spare still importing: used, its imports waited for), cold (processes started anew).",
    ["path"],
    multiprocess_mode="mostrecent",
)
SPARE_EVENTS = Counter(
    "vlguard_engine_spare_events",
    "Spare engine processes by event: spawned, died (replaced), used by a rebuild, refused (a rebuild spawned).",
    ["event"],
)
QUARANTINED = Gauge(
    "vlguard_quarantine_fingerprints",
    "Request fingerprints quarantined (refused) now.",
    multiprocess_mode="mostrecent",
)

# Labelled counters start at 0 for every known label value, so increase() and rate() see the first event.
for _cause in ("deepstack", "process_exit", "hang", "exception"):
    ENGINE_DEATHS.labels(cause=_cause)
for _outcome in ("success", "failure"):
    ENGINE_RESTARTS.labels(outcome=_outcome)
for _result in ("ok", "failed"):
    ENGINE_PROBES.labels(result=_result)
for _kind in ("soft", "rebuild"):
    ENGINE_RECOVERIES.labels(kind=_kind)
    RECOVERY_DURATION.labels(kind=_kind)
for _evidence in ("named", "step_exception"):
    QUARANTINE_STRIKES.labels(evidence=_evidence)
for _reason in (
    "media",
    "body",
    "body_too_large",
    "body_timeout",
    "overload",
    "client_faults",
    "poison",
    "memory",
    "client_memory",
    "route",
    "saturated",
    "deadline",
    "client_share",
    "queued_reqs",
    "queued_tokens",
):
    REQUESTS_REJECTED.labels(reason=_reason)
for _reason in ("disconnect", "deadline"):
    REQUESTS_CANCELLED.labels(reason=_reason)


class _WrittenElsewhere:
    """A metric another process of this server writes: what this one would write is dropped."""

    def labels(self, *_: object, **__: object) -> _WrittenElsewhere:
        return self

    def inc(self, *_: object, **__: object) -> None:
        return None

    set = dec = observe = inc


#: The engine's own metrics: with N API processes (``--api-server-count N``), API process 0 writes them, so
#: that ``/metrics`` shows one engine (every API process sees each death and each soft recovery).
ENGINE_METRICS = (
    "ENGINE_UP", "ENGINE_STATE", "RESTART_BUDGET", "ENGINE_DEATHS", "ENGINE_RESTARTS", "RESTART_DURATION",
    "ENGINE_RECOVERIES", "RECOVERY_DURATION",
)  # fmt: skip
#: The spare engine process's: the process that launches the engine core writes them (the owner, with N).
SPARE_METRICS = ("SPARE_UP", "REBUILD_PATH", "SPARE_EVENTS")


def written_elsewhere(names: tuple[str, ...]) -> None:
    """Drop this process's writes of the metrics ``names`` (attributes of this module): another process of the
    server writes them. Call before the metrics are first written."""
    for name in names:
        globals()[name] = _WrittenElsewhere()
