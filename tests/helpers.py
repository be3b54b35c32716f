"""Test helpers used everywhere: polling with a deadline, the engine-core process of a server, metric
samples, SSE parsing, and request and image builders."""

from __future__ import annotations

import contextlib
import http.server
import io
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil
from PIL import Image, ImageOps

from server.workload.servers import ServerProcess, metric_samples

#: Inputs known to fault vLLM's engine core, refused at the door (CASES C16, C21): name -> (fields over a
#: text chat body, a phrase of the 400's message). Shared by the in-process and the real-engine tests.
POISON_CASES: dict[str, tuple[dict[str, Any], str]] = {
    "json-object-false": ({"structured_outputs": {"json_object": False}}, "no usable constraint"),
    "json-empty": ({"structured_outputs": {"json": ""}}, "no usable constraint"),
    "grammar-uncompilable": ({"structured_outputs": {"grammar": "root ::= ( "}}, "cannot be compiled"),
    "schema-uncompilable": (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "v", "schema": {"type": "strin"}}}},
        "cannot be compiled",
    ),
    "oov-stop-with-min-tokens": ({"stop_token_ids": [10**6], "min_tokens": 2}, "outside the vocabulary"),
    "literal-placeholder": (
        {"messages": [{"role": "user", "content": "look <|vision_start|><|image_pad|><|vision_end|>"}]},
        "placeholder",
    ),
}

PF_EXITING = 0x4  # /proc/<pid>/stat flags: the process is exiting (include/linux/sched.h)

__all__ = [
    "ManualClock",
    "assert_session_ends",
    "chat_body",
    "engine_core",
    "metric",
    "metric_samples",
    "png",
    "poll",
    "session_processes",
    "sse_tokens",
]


class ManualClock:
    """A monotonic clock that moves only when a test sets ``now`` (seconds): what the guard's injectable
    ``clock`` parameters take in unit tests."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def poll(predicate: Callable[[], object], timeout_s: float, what: str, interval_s: float = 0.2) -> Any:
    """Call ``predicate`` until it returns something truthy, and return that.

    Raises:
        AssertionError: ``timeout_s`` seconds passed first (the message names ``what``).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(interval_s)


def _cmdline(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline()) + " " + proc.name() if proc.status() != psutil.STATUS_ZOMBIE else ""
    except psutil.Error:  # gone while we looked
        return ""


def process_name(proc: psutil.Process) -> str:
    """``proc.name()``, or "" when the process is already gone (a child listed a moment ago may have
    exited before its name is read: vLLM's start-up runs short-lived helper processes)."""
    try:
        return proc.name()
    except psutil.Error:
        return ""


def engine_core(srv: ServerProcess, timeout_s: float = 30) -> psutil.Process:
    """The server's one live ``VLLM::EngineCore`` process (waits while a replaced one is still being reaped)."""

    def one() -> psutil.Process | None:
        cores = [p for p in srv.children() if "EngineCore" in _cmdline(p)]
        return cores[0] if len(cores) == 1 else None

    result: psutil.Process = poll(one, timeout_s, "exactly one engine-core process")
    return result


def stall_engine(core: psutil.Process) -> psutil.Process:
    """Stop (SIGSTOP) the model worker of engine core ``core`` so that no request in that engine finishes
    while a test gathers requests in it; returns the worker. The engine core itself keeps running and
    accepting requests, so the guard sees neither a stopped engine core nor (for seconds) a hang; when the
    test then kills the engine core, the guard's teardown must kill the stopped, orphaned worker.

    Raises:
        AssertionError: the engine core has no worker process (CPU engines always have one)."""
    workers = [p for p in core.children() if "Worker" in _cmdline(p)]
    assert len(workers) == 1, [_cmdline(p) for p in core.children()]
    workers[0].suspend()
    return workers[0]


def gone(proc: psutil.Process) -> bool:
    """``proc`` has exited (or is a zombie waiting to be reaped)."""
    try:
        return proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def metric(srv: ServerProcess, name: str) -> float:
    """One metric's value on the server's ``/metrics``, summed over its labels (0 when absent)."""
    return metric_samples(srv.url).get(name, 0.0)


def labelled(srv: ServerProcess, name: str, label: str, text: str | None = None) -> dict[str, float]:
    """``name``'s samples on the server's ``/metrics`` (or in ``text``) by the value of ``label``."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(srv.url + "/metrics").text if text is None else text
    return {s.labels[label]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == name and label in s.labels}  # fmt: skip


def spare_events(srv: ServerProcess) -> dict[str, float]:
    """``vlguard_engine_spare_events_total`` by event (spawned, died, used, refused)."""
    return labelled(srv, "vlguard_engine_spare_events_total", "event")


def spare_processes(srv: ServerProcess) -> list[psutil.Process]:
    """The server's spare engine processes waiting for a rebuild (``vlguard::spare``: the engine core's
    spare, a child of the API process, and the worker's, its child)."""
    return [p for p in srv.children() if process_name(p) == "vlguard::spare"]


def wait_spare_ready(srv: ServerProcess, timeout_s: float = 240) -> None:
    """Wait until the server's spare engine process has imported and warmed up (``vlguard_engine_spare_up``)."""
    poll(lambda: metric(srv, "vlguard_engine_spare_up") == 1, timeout_s, "a ready spare engine process")


def carried_over(srv: ServerProcess) -> float:
    """Requests the server's guard carried over an engine death or a soft recovery so far (replayed or
    resumed)."""
    samples = metric_samples(srv.url)
    return samples.get("vlguard_requests_replayed_total", 0.0) + samples.get("vlguard_requests_resumed_total", 0.0)


def sse_tokens(lines: Iterable[str]) -> tuple[list[int], str | None]:
    """Token ids from an OpenAI chat stream asked with ``logprobs`` and ``return_tokens_as_token_ids``,
    and the error event's message (None when the stream ended without one)."""
    ids: list[int] = []
    for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            return ids, chunk["error"]["message"]
        for choice in chunk.get("choices", []):
            for lp in (choice.get("logprobs") or {}).get("content") or []:
                ids.append(int(lp["token"].removeprefix("token_id:")))
    return ids, None


def chat_body(model: str, *image_urls: str, text: str = "Is anyone wearing a helmet?", **extra: Any) -> dict[str, Any]:
    """A chat request: one user turn with ``text`` then the images (image last, as in the two-pass workload)."""
    content: list[dict[str, Any]] = [{"type": "text", "text": text}]
    content += [{"type": "image_url", "image_url": {"url": u}} for u in image_urls]
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 2, **extra}


def png(width: int, height: int, mode: str = "RGB") -> bytes:
    """A blank PNG of the given size and Pillow mode."""
    buf = io.BytesIO()
    Image.new(mode, (width, height)).save(buf, "PNG")
    return buf.getvalue()


def session_processes(sid: int) -> list[psutil.Process]:
    """Every live (non-zombie) process of session ``sid``: a server started with ``start_new_session`` and
    everything it spawned, whatever vLLM renamed them to and whoever their parent now is."""
    found = []
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == sid and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (OSError, psutil.Error):  # gone while we looked
            continue
    return found


def killed(proc: psutil.Process) -> bool:
    """Whether the kernel is already ending ``proc``: a SIGKILL is pending for it, or it is exiting
    (``PF_EXITING``). Such a process runs no more of its own code, but can take a while to be gone: one in
    uninterruptible sleep (a page fault under memory pressure, say) handles the signal only when it wakes."""
    try:
        status = {k: v.strip() for k, _, v in (line.partition(":") for line in
                  Path(f"/proc/{proc.pid}/status").read_text().splitlines())}  # fmt: skip
        flags = int(Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[6])
    except (OSError, ValueError, IndexError):  # gone while we looked
        return True
    pending = int(status.get("SigPnd", "0"), 16) | int(status.get("ShdPnd", "0"), 16)
    return bool(pending & (1 << (signal.SIGKILL - 1))) or bool(flags & PF_EXITING)


def _resource_tracker(proc: psutil.Process) -> bool:
    """``multiprocessing``'s resource tracker: it ends by itself once the last process using it has."""
    with contextlib.suppress(psutil.Error):
        return "multiprocessing.resource_tracker" in " ".join(proc.cmdline())
    return False


def _unwinding(sid: int) -> bool:
    """Nothing of session ``sid`` runs its own code any more: every process is gone or being ended by the
    kernel, or is the resource tracker waiting for those."""
    left = session_processes(sid)
    dying = [p for p in left if killed(p)]
    return all(p in dying or (dying and _resource_tracker(p)) for p in left)


def _describe(sid: int) -> list[tuple[int, str, str, bool, str]]:
    """(pid, name, state, killed, kernel wait channel) of each process of session ``sid`` still there."""
    found = []
    for p in session_processes(sid):
        with contextlib.suppress(OSError, psutil.Error):
            wchan = Path(f"/proc/{p.pid}/wchan").read_text()
            found.append((p.pid, p.name(), p.status(), killed(p), wchan))
    return found


def assert_session_ends(sid: int, within_s: float = 30, kernel_s: float = 120) -> None:
    """Every process watches its parent twice a second and SIGKILLs itself when the parent is gone, so
    within ``within_s`` nothing of the session runs its own code any more (each process is gone or already
    killed, see :func:`killed`); then the kernel gets ``kernel_s`` more to finish the killed ones (CI saw a
    killed worker in ``disk-sleep`` for more than 30 s, on a machine short of memory).

    Raises:
    AssertionError: a process of session ``sid`` still runs ``within_s`` seconds from now, or is still
        there ``kernel_s`` seconds later (listed with its state and kernel wait channel)."""
    try:
        poll(lambda: _unwinding(sid), within_s, "every process of the server to end or be killed")
    except AssertionError:
        raise AssertionError(f"still running {within_s:g} s after exit: {_describe(sid)}") from None
    try:
        poll(lambda: not session_processes(sid), kernel_s, "the kernel to finish the killed processes")
    except AssertionError:
        raise AssertionError(f"killed but still there {kernel_s:g} s later: {_describe(sid)}") from None


def assert_nothing_left(temp: Path, log: Path) -> None:
    """Nothing of vlguard's is left in ``temp`` (the server's TMPDIR: its metrics and state folders) and no
    process of it reported a leaked shared-memory object at its exit (Python's resource tracker's warning)."""
    assert sorted(p.name for p in temp.glob("vlguard-*")) == []
    assert "leaked shared_memory" not in log.read_text(errors="replace")


def encoded(img: Image.Image, fmt: str = "PNG", **params: Any) -> bytes:
    """``img`` encoded as ``fmt`` (Pillow save parameters in ``params``)."""
    buf = io.BytesIO()
    img.save(buf, fmt, **params)
    return buf.getvalue()


def sample_picture(width: int = 96, height: int = 64) -> Image.Image:
    """An RGB picture with structure in both directions (a turn or a flip changes it), deterministic."""
    cols, rows = np.meshgrid(np.arange(width) * 255 // width, np.arange(height) * 255 // height, indexing="xy")
    return Image.fromarray(np.stack([cols, rows, (cols + rows) % 256], -1).astype(np.uint8), "RGB")


def field_images() -> dict[str, tuple[bytes, bytes, bytes]]:
    """The image rows of CASES/issue #17: name -> ``(as sent, as a viewer shows it, as stock vLLM sees it)``,
    the last two as PNGs no normalisation rule touches.

    * ``exif-jpeg``: a phone JPEG, pixels stored turned 90 degrees with EXIF Orientation=6;
    * ``palette-trns``: a palette PNG whose left half is a transparent red;
    * ``grey16``: a 16-bit greyscale PNG (values 257 x an 8-bit picture).
    """
    upright = sample_picture()
    exif = Image.Exif()
    exif[0x0112] = 6
    jpeg = encoded(upright.transpose(Image.Transpose.ROTATE_90), "JPEG", exif=exif, quality=95)
    stored = Image.open(io.BytesIO(jpeg))
    stored.load()
    shown = ImageOps.exif_transpose(stored)
    rows: dict[str, tuple[bytes, bytes]] = {"exif-jpeg": (jpeg, encoded(shown))}

    palette = Image.new("P", (96, 64), 1)
    palette.putpalette([0, 0, 0, 255, 0, 0, 0, 0, 255])
    palette.paste(2, (48, 0, 96, 64))
    seen_as = Image.new("RGB", (96, 64), (255, 255, 255))
    seen_as.paste((0, 0, 255), (48, 0, 96, 64))
    rows["palette-trns"] = (encoded(palette, transparency=1), encoded(seen_as))

    grey8 = np.asarray(upright.convert("L"))
    grey16 = Image.frombytes("I;16", (96, 64), (grey8.astype(np.uint16) * 257).astype("<u2").tobytes())
    rows["grey16"] = (encoded(grey16), encoded(Image.fromarray(grey8, "L")))
    # What stock vLLM sees: Pillow's convert("RGB") of the image as sent (pixels only: convert() would carry
    # a tRNS colour along into the PNG).
    return {name: (sent, shown, encoded(Image.fromarray(np.asarray(Image.open(io.BytesIO(sent)).convert("RGB")))))
            for name, (sent, shown) in rows.items()}  # fmt: skip


@contextlib.contextmanager
def http_host(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[str]:
    """A threaded HTTP server for ``handler`` on a free 127.0.0.1 port, as its base URL
    (``http://127.0.0.1:PORT``); shut down on exit."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
