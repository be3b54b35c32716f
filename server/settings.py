"""vlguard's own options (everything that is not a ``vllm serve`` flag).

One pydantic ``Settings`` class. Each field becomes a ``--guard-<name>`` CLI flag (its docstring is the
``--help`` text), can be set in a YAML profile as ``guard-<name>: value`` (the same file ``--config``
hands to vLLM's parser), or through the environment as ``VLGUARD_<NAME>``. Precedence: CLI, then the
profile, then the environment, then the default. Built once in the CLI and passed down; never read at
import time.
"""

from __future__ import annotations

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class GuardSettings(BaseSettings):
    """Options of the vlguard wrapper around vLLM."""

    model_config = SettingsConfigDict(env_prefix="VLGUARD_", use_attribute_docstrings=True, extra="forbid", frozen=True)

    patches: bool = True
    """Backport the deepstack fixes into every vLLM process where the installed vLLM needs them, and
    transformers' kept processor schemas into the API process where the installed transformers needs them
    (PR #45807; docs/input.md) (on/off). Off is for A/B runs only."""

    alignment: bool = True
    """Align every step that carries image tokens to a CUDA-graph capture size in the scheduler (on/off),
    so the deepstack buffer is never read past what was written even without the backport."""

    alignment_max_capture_size: int = Field(default=0, ge=0)
    """Align to vLLM's default capture sizes up to this many tokens even when the engine pads nothing
    (CPU runs that emulate CUDA-graph padding, for tests). 0: use the engine's own capture sizes."""

    max_inflight: int = Field(default=1024, ge=0)
    """Generation requests inside vlguard at once (held, queued, running or streaming; counted once their
    body has arrived); one more gets 429 + Retry-After, and /ready answers 503 while all are taken. 0: no
    bound."""

    max_queue_wait: float = Field(default=5.0, ge=0)
    """Seconds a generation request may expect to wait for the engine before its prefill ends; a request
    that cannot expect to start within it (estimated from the engine's queue and recent rates now) gets 503
    + Retry-After at once, before its body is read, and /ready answers 503 (saturated) meanwhile. A request
    with ``X-Request-Timeout: S`` is also refused when it cannot expect to be answered within S seconds, and
    ended at S wherever it is (docs/guard.md). 0: no estimate (only the fixed bounds)."""

    max_request_mb: float = Field(default=64.0, gt=0)
    """Largest request body accepted (MiB); more gets 413."""

    max_body_memory_mb: float | None = Field(default=None, gt=0)
    """Request bodies the API process holds at once, in all (MiB: received, checked, held while the engine
    restarts, served); a request whose body would exceed it gets 429 (503 while the engine restarts).
    Default: one sixteenth of the memory the process may use (the container's cgroup limit, else the
    machine's; an image request costs the API process about four times its body while it is parsed and
    decoded). A body larger than the whole budget gets 413."""

    body_share: float = Field(default=0.25, gt=0, le=1)
    """Fraction of --guard-max-body-memory-mb the bodies of one client may hold at once (a client: its API key
    when the server has several, else its address, IPv6 by /64); one more byte gets 429 + Retry-After, and
    a body larger than the share 413. Stalled or slow uploads from one client then never refuse another's
    request nor turn /ready 503. Clients without an identity (loopback: behind a proxy on the host, which
    keeps its own per-source limits) share the whole budget."""

    max_json_items: int = Field(default=1_000_000, ge=1000)
    """Most values (array items and object members, counted by their commas) one request body may hold;
    more gets 413 before it is parsed. A prompt of token ids needs one per token; an image is one."""

    max_json_objects: int = Field(default=10_000, ge=100)
    """Most JSON objects (messages, content parts, tools and their schemas, at any depth) one request body may
    hold; more gets 413, counted off the event loop for a large body. vLLM parses and validates the body on
    the event loop, about 6 us an object: 450,000 empty messages held /health for 5 s."""

    max_sequences: int = Field(default=16, ge=1)
    """Most sequences one generation request may ask the engine for: ``n`` (or ``best_of``) times the prompts
    of a batched completions request; more gets 400. The engine serves sequences first come, first served:
    one request with n=4000 kept every other client waiting 97 s."""

    inflight_share: float = Field(default=0.25, gt=0, le=1)
    """Fraction of --guard-max-inflight one client's requests may hold at once (a client as for
    --guard-body-share; at least one); one more gets 429 + Retry-After for that client alone, so one client's
    slow streams never take every slot. Loopback clients (no identity) share the whole bound."""

    header_timeout: float = Field(default=10.0, gt=0)
    """Seconds a request's headers may take to arrive (from the connection's opening, or the first byte of
    the next request on a kept-alive connection); slower connections are closed (slowloris: uvicorn alone
    kept them open for ever)."""

    max_header_kb: int = Field(default=64, ge=1)
    """KiB a request's line and headers may take (under either HTTP parser); more gets 431 and the
    connection closed. uvicorn's httptools parser took a 98 MB header block, parsing it on the event loop
    for 1.2 s."""

    body_timeout: float = Field(default=30.0, gt=0)
    """Seconds a request body may take to arrive completely; slower gets 408. A request takes one of the
    ``max_inflight`` slots only once its body has arrived, so stalled uploads cannot fill them."""

    max_image_mb: float = Field(default=20.0, gt=0)
    """Largest decoded size of one image or other media item (MiB); more gets 413."""

    max_image_pixels: int = Field(default=50_000_000, gt=0)
    """Largest image (width x height, read from the header before decoding); more gets 400. Refuses
    decompression bombs before anything decodes them."""

    max_aspect_ratio: float = Field(default=200.0, ge=1)
    """Largest long-side / short-side ratio of an image (Qwen's processor refuses above 200); more gets 400."""

    max_video_frames: int = Field(default=32, ge=1)
    """Most frames one video may decode (vLLM samples 32 by default); a video that would decode more, or a
    request's ``media_io_kwargs`` asking for more, gets 400. Each frame meets the image limits."""

    decode_threads: int = Field(default=2, ge=1)
    """Threads that normalise images, where vLLM loads them (a pool of vlguard's own: an image waiting
    for it holds none of vLLM's threads; images no normalisation rule applies to never wait for it)."""

    decode_pixels: int | None = Field(default=None, gt=0)
    """Pixels (width x height) being normalised at once, over all decode threads; an image waits for its
    share (about 20 bytes a pixel while it is normalised). Default and minimum: ``max_image_pixels``
    (one image of the largest size allowed)."""

    image_cache_mb: float = Field(default=256.0, ge=0)
    """MiB of decoded images each API process keeps, by the SHA-256 of their bytes, so that an image sent
    again (the two-pass workload sends each twice) is not decoded again: each load gets its own copy of the
    same pixels; least recently used first out (docs/input.md). 0: off, every image decoded (stock)."""

    image_normalize: bool = True
    """Normalise images where vLLM loads them so the engine sees what viewers show (on/off): EXIF orientation
    applied, transparency composited on white, 16/32-bit scaled to 8 bits (docs/input.md). Off: images
    reach vLLM exactly as sent (stock behaviour)."""

    trust_client_uuids: bool = False
    """Let a media part's client-supplied ``uuid`` stand for its content in vLLM's caches (on/off). Off:
    vlguard drops every ``uuid`` at the door so vLLM hashes the media itself (a reused ``uuid`` with another
    image was answered about the first: vllm#55547), and a ``uuid`` without media gets 400. On only when
    every client is trusted and relies on uuid-only references."""

    forwarded_allow_ips: str | None = None
    """Addresses (comma-separated; ``*`` for any) whose ``X-Forwarded-For`` header vlguard takes as the
    client's address (for logs and the per-client fault budget). Default: uvicorn's
    ``FORWARDED_ALLOW_IPS`` environment variable, else ``127.0.0.1``: a proxy on the same host that sets
    the header itself, as the shipped HAProxy does (it drops the client's own). Set it to an empty string
    when whatever connects from those addresses passes clients' headers through: a client could then
    choose its address, and have another client's address refused."""

    keep_alive_timeout: float | None = Field(default=None, gt=0)
    """Seconds an idle HTTP keep-alive connection is kept open. Default: vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE
    when set, else 75 (above the 60 s idle timeouts of nginx upstream pools and cloud load balancers, so a
    proxy never reuses a connection the server is closing)."""

    remote_media: bool = False
    """Accept http(s) image URLs (on/off). Off: images must come as data: URIs. On: vlguard fetches them
    from the hosts in --allowed-media-domains only (public addresses, checked redirects, bounded size and
    time) and hands vLLM the image inline."""

    remote_media_timeout: float = Field(default=10.0, gt=0)
    """Seconds one remote image fetch may take, redirects included; slower gets 504."""

    startup_timeout: float = Field(default=1800.0, gt=0)
    """Seconds the engine may take to load and compile (at start and at each restart) before that
    attempt is declared failed."""

    rebuild_timeout: float | None = Field(default=None, gt=0)
    """Seconds one rebuild may take before it is abandoned (the processes it started are killed; the spare
    kept for the next rebuild is not) and tried again, within the restart budget. Unset: 3x the last cold
    build (the first start until a cold rebuild is measured), at least 300 s, at most
    --guard-startup-timeout. A rebuild stuck on a stopped or hung process then costs minutes, not the
    start-up timeout (docs/guard.md)."""

    soft_recovery: bool = True
    """Absorb an exception raised inside one engine step without a rebuild (on/off): the engine's caches
    are reset and every request in it is carried over onto the same engine (docs/guard.md). Device
    errors, dead processes and hangs always rebuild."""

    spare: bool = True
    """Keep a spare engine-core process (and its worker), spawned and imported once the engine is ready,
    for the next rebuild (on/off): a rebuild after a process death then skips the processes' start-up and
    imports (docs/guard.md). The spare touches no device; it costs two idle processes' memory (0.8 and 0.9 GiB
    resident on the CPU build)."""

    soft_recovery_max: int = Field(default=10, ge=0)
    """Soft recoveries allowed within ``restart_window`` seconds; the next fault rebuilds the engine. A
    fault charged to exactly one request does not count (it is that request's: quarantine, client budget);
    one charged to a whole step of several requests, or to nobody, does."""

    restart_max: int = Field(default=5, ge=0)
    """In-process engine restarts allowed within ``restart_window`` seconds; one more and the process
    exits non-zero so systemd or Docker restart it. A rebuild after a fault charged to exactly one request
    (a poison input that killed its worker) does not count."""

    client_fault_max: int = Field(default=10, ge=0)
    """Engine faults charged with certainty to one client's requests (API key when the server has keys,
    else the remote address) within ``restart_window`` seconds before that client is refused with 429 for
    ``client_cooldown`` seconds. 0: never refuse."""

    client_cooldown: float = Field(default=60.0, gt=0)
    """Seconds a client stays refused once its requests spent its fault budget; its faults stay counted
    for the window, so one more fault within it refuses it again."""

    restart_window: float = Field(default=600.0, gt=0)
    """Seconds over which ``restart_max`` is counted."""

    restart_backoff: float = Field(default=1.0, ge=0)
    """Seconds before the second restart attempt after a failed one; doubles with each failure."""

    hold_timeout: float | None = Field(default=None, gt=0)
    """Seconds a request waits for the engine to become ready before it gets 503 + Retry-After. Unset:
    measured (docs/guard.md): 120 s, or 1.5x the last rebuild on the path the rebuild in progress takes
    (through a ready spare engine process; cold, or through a spare still importing: 1.5x the last cold
    build + 30 s), whichever is longer; the first start waits up to --guard-startup-timeout."""

    max_held: int = Field(default=512, ge=0)
    """Requests that may wait for the engine at once; more get 503 + Retry-After at once."""

    max_replays: int = Field(default=3, ge=0)
    """Times one request may be replayed or resumed on a new engine."""

    quarantine_deaths: int = Field(default=2, ge=1)
    """Engine faults a request may be charged with (it was in the step whose execution raised) before it is
    quarantined (refused, never replayed). Kills, crashes and hangs of the engine core charge nobody."""

    operator_key: SecretStr | None = None
    """Bearer key for the operator routes (/admin/quarantine). Unset: the API key (--api-key) opens them;
    with no key at all they are closed unless --guard-admin-loopback is on. Set it through the environment
    (VLGUARD_OPERATOR_KEY) or a profile, not on the command line (process listings show arguments)."""

    admin_loopback: bool = False
    """Trust loopback clients on the operator routes when no key is set (on/off). Off by default: behind a
    proxy or sidecar on the same host every client is loopback."""

    quarantine_size: int = Field(default=4096, ge=1)
    """Fingerprints the quarantine remembers at most (least recently seen are forgotten first)."""

    quarantine_ttl: float = Field(default=3600.0, gt=0)
    """Seconds after its last strike that a fingerprint is forgotten."""

    forensics_dir: str | None = None
    """Directory for a forensic record of every request charged with an engine fault or quarantined (off
    when unset): the request as the engine received it (route, body, prompt token ids, sampling
    parameters), its fingerprint, each fault with its traceback, the other requests of the failing step
    (ids and fingerprints), the engine's versions and non-secret arguments. No header is kept, so no
    credential. ``vlguard forensics list|replay`` reads them (docs/guard.md)."""

    forensics_media: bool = False
    """Keep the media (base64 images) of a forensic record's body (on/off). Off: each is replaced by its
    SHA-256 and size (a record with media omitted cannot be replayed as it was)."""

    forensics_max_records: int = Field(default=200, ge=1)
    """Forensic records kept at most; the oldest are removed first."""

    forensics_max_mb: float = Field(default=256.0, gt=0)
    """MiB the forensic records may take in all; the oldest are removed first (a record larger than this
    alone is written without its body)."""

    probation_drain_timeout: float = Field(default=30.0, ge=0)
    """Seconds a request on probation (a strike on its record) waits for the requests already in the engine
    to finish so that it runs alone; past it, it runs beside them. New requests wait while its first step
    runs."""

    hang_timeout: float = Field(default=60.0, gt=0)
    """Seconds of no engine output while requests are pending before the engine counts as hung."""

    watchdog_interval: float = Field(default=1.0, gt=0)
    """Seconds between the supervisor's liveness checks of the engine-core process."""

    ready_probe_interval: float = Field(default=10.0, gt=0)
    """A one-token readiness probe runs when the engine is idle and this many seconds passed without a
    probe or real output; /ready needs one of them within three intervals."""

    drain_timeout: float = Field(default=30.0, ge=0)
    """Seconds SIGTERM waits for in-flight requests before the engine is stopped."""

    shutdown_delay: float = Field(default=0.0, ge=0)
    """Seconds between SIGTERM and the start of the drain: /ready answers 503 at once while new requests
    are still accepted and served, so that a load balancer stops routing here before connections close
    (set it above the balancer's detection time; HAProxy: inter x fall). A second signal starts the
    drain at once."""

    shutdown_timeout: float = Field(default=15.0, gt=0)
    """Seconds the engine's own shutdown (and an engine build still in progress) may take at exit before
    vlguard kills the engine's processes."""

    def body_memory_bytes(self) -> int:
        """``max_body_memory_mb`` in bytes, or its default (a sixteenth of the machine's memory)."""
        if self.max_body_memory_mb is not None:
            return int(self.max_body_memory_mb * 1024 * 1024)
        return _default_body_memory()

    def decode_pixel_budget(self) -> int:
        """``decode_pixels``, at least ``max_image_pixels`` (an admitted image must be able to decode)."""
        return max(self.decode_pixels or 0, self.max_image_pixels)


def _default_body_memory() -> int:
    """A sixteenth of the memory this process may use: the cgroup's limit (a container's) when there is
    one, else the machine's."""
    from pathlib import Path

    import psutil

    total = int(psutil.virtual_memory().total)
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit.isdigit():
            total = min(total, int(limit))
    except OSError:
        pass
    return total // 16


def settings_from_flags(flags: dict[str, str]) -> GuardSettings:
    """Build the settings from explicitly given ``guard_*`` flags (CLI or profile) over the environment.

    Arguments:
        flags: field name (without the ``guard_`` prefix) to raw string value.

    Raises:
        pydantic.ValidationError: a value is out of range or of the wrong type.
    """
    return GuardSettings(**flags)  # type: ignore[arg-type]
