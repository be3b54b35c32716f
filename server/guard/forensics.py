"""Forensic records (API process, opt-in with ``--guard-forensics-dir``): what an operator needs to reproduce
the request that faulted the engine.

When a request is charged with an engine fault (a fatal one, one soft recovery absorbed, or one of its own
output processing: :mod:`server.guard.accounting`), this module writes, or updates, one JSON record per
fingerprint, ``<fingerprint>.json``:

- the request as the engine received it: the route and the body the door handed on, the prompt token ids
  and image hashes of the engine input, the sampling parameters (their ``repr``);
- the fingerprint, the client's identity (an address or a key's hash, never the key), whether it is
  quarantined;
- each fault charged to it: when, its kind, the exception, its traceback, how it was charged (named by the
  failing code or the whole step's), and the other requests of the failing step (ids and fingerprints only);
- the vLLM and vlguard versions and the engine's non-secret arguments.

No header is kept (so no ``Authorization`` or ``Cookie``). Media in the body (``data:`` URLs) are kept only
with ``--guard-forensics-media``, else replaced by their SHA-256 and size. Records are written by one
thread of their own, atomically (a temporary file renamed), bounded in count and bytes (the oldest removed
first); at most :data:`MAX_PENDING` writes wait at once (more are dropped with a warning). A failing disk
costs the record, never the request.
"""

from __future__ import annotations

import contextvars
import hashlib
import json
import logging
import os
import re
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from server.engine.protocol import FatalRecord, SoftFault

logger = logging.getLogger(__name__)

#: The route and body of the request being served, as the door handed them on (set at the door, read by
#: the engine client): ``(route, body)``.
current_request: contextvars.ContextVar[tuple[str, bytes] | None] = contextvars.ContextVar(
    "vlguard_request", default=None
)

#: Record writes waiting at once; more are dropped (a flood of faults must not grow memory).
MAX_PENDING = 64
#: Engine arguments whose name says they hold a secret: never written (nor such keys inside a value).
SECRET = re.compile(r"key|token|secret|password|credential", re.IGNORECASE)
#: A secret inside a text value: a URL's user information, or ``name=value`` / ``name: value`` whose name
#: says it is a secret (a query string, a JSON or option string).
_SECRET_IN_TEXT = (
    (re.compile(r"(?<=://)[^/@\s]+@"), "<redacted>@"),
    (
        re.compile(r"(?i)([\w.-]*(?:key|token|secret|password|credential)[\w.-]*[\"']?\s*[=:]\s*[\"']?)[^\s&,;\"'}]+"),
        r"\1<redacted>",
    ),
)
REDACTED = "<redacted>"
#: A record's file name: its fingerprint (16 hex characters, server.guard.quarantine.fingerprint).
_RECORD_NAME = re.compile(r"[0-9a-f]{16}\.json")
#: A ``data:`` URL in a body (an inline image, video or audio).
_DATA_URL = re.compile(r"^data:[^,]{0,200},", re.IGNORECASE)
#: What stands in a record's body for an omitted media item.
OMITTED = "<vlguard forensics: media omitted, sha256={sha256}, {size} bytes>"


@dataclass(frozen=True)
class Evidence:
    """What the engine client knows of one request (references only; read when a fault is charged).

    Attributes:
        route: ``"POST /v1/chat/completions"``, or None outside an HTTP request.
        body: the body the door handed on (after its rewrites), or None.
        prompt: the engine input (a dict with ``prompt_token_ids`` and, for images, ``mm_hashes``).
        sampling_params: vLLM's ``SamplingParams``.
        client: the client's identity (:func:`server.guard.clients.client_key`), "" when none.
    """

    route: str | None
    body: bytes | None
    prompt: Any
    sampling_params: Any
    client: str = ""


@dataclass(frozen=True)
class Charge:
    """One fault charged to a request.

    Attributes:
        kind: ``fatal`` (the engine died), ``soft`` (absorbed in the engine core) or ``output`` (its output
            processing raised in this process).
        record: what the engine core (or the output processor) recorded.
        peers: the other requests of the failing step: ``(request id, fingerprint)``.
        quarantined: the request is quarantined now.
        at: Unix seconds.
    """

    kind: str
    record: FatalRecord | SoftFault
    peers: list[tuple[str, str]] = field(default_factory=list)
    quarantined: bool = False
    at: float = field(default_factory=time.time)


def engine_facts(engine_args: dict[str, Any]) -> dict[str, Any]:
    """The versions and the non-secret engine arguments a record carries (values as JSON, else their
    ``repr``)."""
    import vllm

    from server import __version__

    args = {}
    for name, value in sorted(engine_args.items()):
        if SECRET.search(name):
            continue
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            value = repr(value)
        args[name] = redact(value)
    return {"vllm_version": vllm.__version__, "vlguard_version": __version__, "args": args}


def redact(value: Any) -> Any:
    """``value`` (JSON-like) with every secret inside it replaced by :data:`REDACTED`: the values of keys
    whose name says they hold one (:data:`SECRET`), and secrets written into text (:data:`_SECRET_IN_TEXT`)."""
    if isinstance(value, dict):
        return {k: REDACTED if SECRET.search(str(k)) else redact(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact(v) for v in value]
    if isinstance(value, str):
        for pattern, replacement in _SECRET_IN_TEXT:
            value = pattern.sub(replacement, value)
    return value


def _omit_media(value: Any) -> Any:
    """``value`` (a parsed JSON body) with every ``data:`` URL replaced by :data:`OMITTED`."""
    if isinstance(value, dict):
        return {k: _omit_media(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_omit_media(v) for v in value]
    if isinstance(value, str) and _DATA_URL.match(value):
        data = value.encode()
        return OMITTED.format(sha256=hashlib.sha256(data).hexdigest(), size=len(data))
    return value


def _body(raw: bytes | None, keep_media: bool) -> Any:
    if raw is None:
        return None
    try:
        body = json.loads(raw)
    except ValueError:
        return {"unparsed": len(raw)}
    return body if keep_media else _omit_media(body)


def build_record(
    existing: dict[str, Any] | None,
    request_id: str,
    fp: str,
    evidence: Evidence | None,
    charge: Charge,
    keep_media: bool,
    engine: dict[str, Any],
) -> dict[str, Any]:
    """The record of ``fp`` after ``charge`` (``existing``: the record written so far, whose faults it
    keeps)."""
    prompt = evidence.prompt if evidence is not None else None
    fault = {
        "at": charge.at,
        "kind": charge.kind,
        "request_id": request_id,
        "type": charge.record.type,
        "message": charge.record.message,
        "traceback": charge.record.traceback,
        "charged_as": "named" if charge.record.named else "step",
        "step_peers": [{"request_id": r, "fingerprint": f} for r, f in charge.peers],
    }
    record = dict(existing or {})
    record.update(
        {
            "format": 1,
            "fingerprint": fp,
            "first_at": record.get("first_at", charge.at),
            "last_at": charge.at,
            "quarantined": charge.quarantined or bool(record.get("quarantined")),
            "faults": [*record.get("faults", []), fault],
            "engine": engine,
        }
    )
    if evidence is not None and "body" not in record:
        record.update(
            {
                "route": evidence.route,
                "body": _body(evidence.body, keep_media),
                "media_kept": keep_media,
                "client": evidence.client,
                "prompt_token_ids": prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None,
                "mm_hashes": prompt.get("mm_hashes") if isinstance(prompt, dict) else None,
                "sampling_params": repr(evidence.sampling_params),
            }
        )
    return record


class Forensics:
    """Writes and prunes the records in ``directory``.

    Arguments:
        directory: created if missing.
        keep_media: keep the bodies' media (else their hashes and sizes).
        max_records, max_bytes: bounds over every record; the oldest go first.
        engine: :func:`engine_facts`.
    """

    def __init__(
        self, directory: str | Path, keep_media: bool, max_records: int, max_bytes: int, engine: dict[str, Any]
    ) -> None:
        self.directory = Path(directory)
        self.keep_media, self.max_records, self.max_bytes, self.engine = keep_media, max_records, max_bytes, engine
        self._slots = threading.BoundedSemaphore(MAX_PENDING)
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="vlguard-forensics")
        self.written = 0  # records written or updated (for tests and logs)

    def path(self, fp: str) -> Path | None:
        """The record of ``fp``, when there is one."""
        path = self.directory / f"{fp}.json"
        return path if path.is_file() else None

    def charged(self, request_id: str, fp: str, evidence: Evidence | None, charge: Charge) -> None:
        """Queue the update of ``fp``'s record. Never blocks, never raises."""
        if not self._slots.acquire(blocking=False):
            logger.warning("forensic record of %s dropped: %d writes already waiting", fp, MAX_PENDING)
            return
        try:
            self._writer.submit(self._write, request_id, fp, evidence, charge)
        except RuntimeError:  # shut down
            self._slots.release()

    def _write(self, request_id: str, fp: str, evidence: Evidence | None, charge: Charge) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            target = self.directory / f"{fp}.json"
            try:
                existing = json.loads(target.read_text())
            except (OSError, ValueError):
                existing = None
            record = build_record(existing, request_id, fp, evidence, charge, self.keep_media, self.engine)
            data = json.dumps(record, indent=1, default=repr).encode()
            if len(data) > self.max_bytes:  # alone over the bound: without the request's content
                record.update(body=None, prompt_token_ids=None, truncated=len(data))
                data = json.dumps(record, indent=1, default=repr).encode()
            self._atomic_write(target, data)
            self.written += 1
            self._prune(keep=target)
        except Exception:
            logger.exception("forensic record of %s not written", fp)
        finally:
            self._slots.release()

    def _atomic_write(self, target: Path, data: bytes) -> None:
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=self.directory)
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(data)
            os.replace(tmp, target)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def _prune(self, keep: Path) -> None:
        """Remove the oldest records until at most ``max_records`` and ``max_bytes`` remain (``keep``
        stays)."""
        records = []
        for path in self.directory.glob("*.json"):
            if not _RECORD_NAME.fullmatch(path.name):  # not one of its records: another's file, left alone
                continue
            try:
                stat = path.stat()
            except OSError:
                continue
            records.append((stat.st_mtime, path, stat.st_size))
        records.sort()
        total = sum(size for _, _, size in records)
        for _, path, size in records:
            if len(records) <= self.max_records and total <= self.max_bytes:
                break
            if path == keep:
                continue
            path.unlink(missing_ok=True)
            records = [r for r in records if r[1] != path]
            total -= size

    def close(self, wait: bool = True) -> None:
        """Finish (``wait``) the writes queued and stop the writer."""
        self._writer.shutdown(wait=wait)


def read_records(directory: str | Path) -> list[dict[str, Any]]:
    """Every readable record in ``directory``, oldest fault first."""
    found = []
    for path in Path(directory).glob("*.json"):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and "fingerprint" in record:
            found.append({**record, "path": str(path)})
    return sorted(found, key=lambda r: r.get("first_at", 0))


__all__ = ["Charge", "Evidence", "Forensics", "build_record", "current_request", "read_records"]
