"""``vlguard forensics``: read the forensic records a server wrote (``--guard-forensics-dir``,
:mod:`server.guard.forensics`) and send a recorded request again.

- ``vlguard forensics list DIR``: one line per record: when, fingerprint, faults, cause, route, quarantined.
- ``vlguard forensics replay RECORD --base URL [--api-key K]``: sends the recorded body to the recorded
  route of any OpenAI-compatible server (vlguard or stock vLLM) and reports the outcome: the HTTP status,
  and the error message or the start of the answer. Exit status 0 when the server answered (whatever it
  answered), 1 when it could not be reached, 2 when the record cannot be replayed (its media were not kept).

A client: imports no vLLM.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Any

import httpx

from server.guard.forensics import read_records

#: The start of what stands in a record's body for an omitted media item (:data:`server.guard.forensics.OMITTED`).
_OMITTED = "<vlguard forensics: media omitted"


def _when(seconds: float | None) -> str:
    if not seconds:
        return "-"
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")


def list_lines(directory: str | Path) -> list[str]:
    """The table of the records in ``directory``, a header first."""
    lines = [f"{'last fault (UTC)':<19}  {'fingerprint':<16}  faults  {'cause':<24}  {'route':<28}  quarantined"]
    for record in read_records(directory):
        faults = record.get("faults") or [{}]
        cause = f"{faults[-1].get('kind', '?')} {faults[-1].get('type', '?')}"
        route = record.get("route") or "-"
        lines.append(
            f"{_when(record.get('last_at')):<19}  {record['fingerprint']:<16}  {len(faults):>6}  {cause[:24]:<24}  "
            f"{route[:28]:<28}  {'yes' if record.get('quarantined') else 'no'}"
        )
    return lines


def _omitted(value: Any) -> bool:
    if isinstance(value, dict):
        return any(_omitted(v) for v in value.values())
    if isinstance(value, list):
        return any(_omitted(v) for v in value)
    return isinstance(value, str) and value.startswith(_OMITTED)


def replay(record: dict[str, Any], base: str, api_key: str | None = None, timeout_s: float = 300) -> tuple[int, str]:
    """Send ``record``'s body to its route on the server at ``base``.

    Returns:
        ``(HTTP status, outcome)``: the error message of an OpenAI error envelope (a stream's error event
        included), else the start of the answer.
    Raises:
        ValueError: the record holds no route or body, or its media were not kept.
        httpx.HTTPError: the server could not be reached.
    """
    route, body = record.get("route"), record.get("body")
    if not route or not isinstance(body, dict):
        raise ValueError("the record holds no request body (recorded outside an HTTP request, or truncated)")
    if _omitted(body):
        raise ValueError("the record's media were not kept (--guard-forensics-media off): it cannot be replayed")
    method, _, path = route.partition(" ")
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    resp = httpx.request(method, base.rstrip("/") + path, json=body, headers=headers, timeout=timeout_s)
    text = resp.text
    for line in text.splitlines():  # a stream: its error event, if any
        if line.startswith("data: {") and '"error"' in line:
            text = line.removeprefix("data: ")
            break
    try:
        data = json.loads(text)
    except ValueError:
        return resp.status_code, text[:300]
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        return resp.status_code, str(data["error"].get("message"))
    return resp.status_code, text[:300]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vlguard forensics", description="Forensic records of faulting requests.")
    sub = parser.add_subparsers(dest="action", required=True)
    listing = sub.add_parser("list", help="one line per record in DIR")
    listing.add_argument("dir", type=Path)
    again = sub.add_parser("replay", help="send a recorded request to a server and report the outcome")
    again.add_argument("record", type=Path, help="a record file (<fingerprint>.json)")
    again.add_argument("--base", required=True, help="the server's URL, e.g. http://127.0.0.1:8000")
    again.add_argument("--api-key", default=None, help="bearer key for the server")
    again.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the answer (default 300)")
    return parser


def main(argv: list[str]) -> int:
    """Entry point of ``vlguard forensics``; the exit status."""
    args = build_parser().parse_args(argv)
    if args.action == "list":
        print("\n".join(list_lines(args.dir)))
        return 0
    try:
        record = json.loads(args.record.read_text())
        status, outcome = replay(record, args.base, args.api_key, args.timeout)
    except (OSError, ValueError) as exc:
        print(f"vlguard forensics replay: {exc}", file=sys.stderr)
        return 2
    except httpx.HTTPError as exc:
        print(f"vlguard forensics replay: {args.base} not reached: {exc}", file=sys.stderr)
        return 1
    print(f"HTTP {status}: {outcome}")
    return 0
