"""#35 on every engine lane: a stream carried over a recovery answers exactly what it answers
uninterrupted, whatever decoding state it has: greedy, seeded sampling, penalties, logit bias,
``min_tokens``, stop strings and stop token ids, logprobs with top logprobs, and structured outputs
(regex, choice, grammar, JSON schema, JSON object).

Each carry-over kind (the engine core killed with ``kill -9``; a soft recovery of a fault the test plugin
raises while admitting a poison request, which cuts every request in the engine) interrupts one staged
batch on the session's eager server: the same rows started in three waves, so that at the fault the
first wave is near its last token, the second in its middle, the third just past its first token.
Each stream's token ids, text, logprobs (within 1e-4), top logprobs, ``finish_reason`` and ``usage``
are compared with the same request run uninterrupted; structured outputs that finished must match
their constraint.

Seeded sampling is exact only where the engine's seeded sampling is reproducible. vLLM 0.20 and 0.22 on
the CPU ignore every request's seed in a batch that also holds an unseeded request (their CPU sampler
falls back to unseeded sampling unless every row has a generator; 0.32's rewrite honours them; the GPU
path always did): the reference runs the seeded row twice to tell. Where it is not reproducible, a
seeded stream re-run after sending tokens (the server's log names each request it re-ran) must end with
the "diverged" error event, never with a silently different continuation.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.conftest import EAGER_ADMIT_WORD, slow_steps_flag
from tests.helpers import carried_over, engine_core, labelled, poll
from tests.lanes import CPU_SAMPLER_KEEPS_SEEDS, VLLM_VERSION
from tests.servers import ServerProcess

pytestmark = pytest.mark.lane  # in every engine lane's focused suite

SHORT, LONG = 48, 80  # max_tokens of the first and late waves, and of the middle wave
#: The late wave's tokens when the first wave is started; the fault follows the first wave's first token.
LATE_AT = 28
WAVES = {"late": SHORT, "middle": LONG, "first": SHORT}
PROMPT = [{"role": "user", "content": "Write the safety log for the loading bay, one line per check."}]
REGEX = "(ab){20}c"
CHOICES = ["safe", "unsafe", "unclear"]
GRAMMAR = 'root ::= item (", " item)* "."\nitem ::= "yes" | "no" | "maybe"'
SCHEMA = {
    "type": "object",
    "properties": {"verdict": {"enum": ["safe", "unsafe"]}, "notes": {"type": "array", "items": {"type": "string"}}},
    "required": ["verdict", "notes"],
}
WAIT_S = 180
#: Seconds each engine step sleeps from the first wave's start until the fault has landed: the engine stays
#: nearly still while the fault travels to it, however far the streams' output and the poison request lag
#: behind the engine on a busy machine (a CI run saw a soft fault land after the whole batch had ended).
CRAWL_STEP_S = 0.2


def rows(stop_text: str, token_a: int, token_b: int) -> dict[str, dict[str, Any]]:
    """The matrix's rows (request fields beyond the common ones), from a greedy run's text and tokens."""
    greedy = {"temperature": 0}
    return {
        "greedy": {**greedy, "ignore_eos": True},
        "seeded": {"temperature": 1.0, "top_p": 0.9, "seed": 7, "ignore_eos": True},
        "frequency": {**greedy, "frequency_penalty": 1.5, "ignore_eos": True},
        "presence+repetition": {**greedy, "presence_penalty": 1.0, "repetition_penalty": 1.3, "ignore_eos": True},
        "min_tokens+stop_ids+bias": {
            **greedy,
            "min_tokens": 25,
            "stop_token_ids": [token_a],
            "logit_bias": {str(token_a): 4.0, str(token_b): -100},
        },
        "stop": {**greedy, "stop": [stop_text]},
        "regex": {**greedy, "structured_outputs": {"regex": REGEX}},
        "grammar": {**greedy, "structured_outputs": {"grammar": GRAMMAR}},
        "json_schema": {
            **greedy,
            "response_format": {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA}},
        },
        "json_object": {**greedy, "response_format": {"type": "json_object"}},
    }


@dataclass
class Stream:
    """What one streamed chat completion delivered."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[str, float]]] = field(default_factory=list)
    text: str = ""
    finish: str | None = None
    usage: dict[str, Any] | None = None
    error: str | None = None
    got: asyncio.Event = field(default_factory=asyncio.Event)  # set at every token
    at_fault: int = -1  # tokens received when the fault was made
    rid: str = ""  # the response's id: the request id in the server's log

    def same_as(self, other: Stream) -> list[str]:
        """Differences from ``other``, by field (empty when the same)."""
        diff = [name for name in ("ids", "text", "finish", "error") if getattr(self, name) != getattr(other, name)]
        if _counts(self.usage) != _counts(other.usage):  # cached prompt tokens may differ: not compared
            diff.append("usage")
        if len(self.logprobs) != len(other.logprobs) or any(
            abs(a - b) > 1e-4 for a, b in zip(self.logprobs, other.logprobs, strict=False)
        ):
            diff.append("logprobs")
        if [[t for t, _ in pos] for pos in self.top] != [[t for t, _ in pos] for pos in other.top] or any(
            abs(a - b) > 1e-4
            for p, q in zip(self.top, other.top, strict=False)
            for (_, a), (_, b) in zip(p, q, strict=False)
        ):
            diff.append("top_logprobs")
        return diff


def _counts(usage: dict[str, Any] | None) -> tuple[Any, ...] | None:
    if usage is None:
        return None
    return usage.get("prompt_tokens"), usage.get("completion_tokens"), usage.get("total_tokens")


async def stream(client: httpx.AsyncClient, model: str, fields: dict[str, Any], out: Stream, max_tokens: int) -> Stream:
    body = {"model": model, "messages": PROMPT, "max_tokens": max_tokens, "stream": True, "logprobs": True,
            "top_logprobs": 3, "return_tokens_as_token_ids": True, "stream_options": {"include_usage": True},
            **fields}  # fmt: skip
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            out.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:300]}"
            return out
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                out.error = chunk["error"]["message"]
                break
            out.rid = out.rid or chunk.get("id", "")
            out.usage = chunk.get("usage") or out.usage
            for choice in chunk.get("choices") or []:
                out.text += choice["delta"].get("content") or ""
                out.finish = choice.get("finish_reason") or out.finish
                for lp in (choice.get("logprobs") or {}).get("content") or []:
                    out.ids.append(int(lp["token"].removeprefix("token_id:")))
                    out.logprobs.append(lp["logprob"])
                    out.top.append([(t["token"], t["logprob"]) for t in lp["top_logprobs"]])
                    out.got.set()
    return out


async def until(stream_: Stream, tokens: int) -> None:
    """Wait until ``stream_`` received ``tokens`` tokens (or ended)."""
    deadline = time.monotonic() + WAIT_S
    while len(stream_.ids) < tokens and stream_.finish is None and stream_.error is None:
        assert time.monotonic() < deadline, f"stream stuck at {len(stream_.ids)} tokens"
        stream_.got.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stream_.got.wait(), 1)


def check_constraint(name: str, s: Stream) -> None:
    """A structured output that finished on its own matches its constraint."""
    if s.finish != "stop":
        return
    if name == "regex":
        assert re.fullmatch(REGEX, s.text), s.text
    elif name == "grammar":
        assert re.fullmatch(r"(yes|no|maybe)(, (yes|no|maybe))*\.", s.text), s.text
    elif name == "choice":
        assert s.text in CHOICES, s.text
    elif name.startswith("json"):
        value = json.loads(s.text)
        assert isinstance(value, dict)
        if name == "json_schema":
            assert value["verdict"] in ("safe", "unsafe") and isinstance(value["notes"], list)


def named_rows(matrix: dict[str, dict[str, Any]], wave: str) -> dict[str, dict[str, Any]]:
    """A wave's rows: the matrix, and ``choice`` (a few tokens long) in the first wave only."""
    return (
        {**matrix, "choice": {"temperature": 0, "structured_outputs": {"choice": CHOICES}}}
        if wave == "first"
        else matrix
    )


async def staged_batch(
    srv: ServerProcess,
    model: str,
    matrix: dict[str, dict[str, Any]],
    crawl: Callable[[], None],
    fault: Callable[[], Awaitable[None]],
) -> dict[tuple[str, str], Stream]:
    """Three waves of the matrix. The late (``SHORT`` tokens) and middle (``LONG``) waves start together
    and run in step; once the late wave has ``LATE_AT`` tokens the engine is made to crawl (``crawl()``) and
    the first wave starts, and the fault is made once each of its rows sent its first token (or the late
    wave is 4 tokens from its end): the late wave is then near its end, the middle one in its middle."""
    results: dict[tuple[str, str], Stream] = {}
    tasks: list[asyncio.Task[Stream]] = []
    async with httpx.AsyncClient(base_url=srv.url, timeout=WAIT_S) as client:

        def start(wave: str) -> list[Stream]:
            for name, fields in named_rows(matrix, wave).items():
                results[(wave, name)] = Stream()
                tasks.append(asyncio.create_task(stream(client, model, fields, results[(wave, name)], WAVES[wave])))
            return [s for (w, _), s in results.items() if w == wave]

        start("late")
        start("middle")
        late = results[("late", "greedy")]
        await until(late, LATE_AT)
        crawl()
        firsts = start("first")
        # The first wave's plain rows have sent their first token: a stop-string stream then holds text back,
        # which the fault's cut must not hand on (a CI run on 0.32 caught it when this row happened to).
        for name in ("greedy", "stop"):
            await until(results[("first", name)], 1)
        # So has every other row, unless the late wave is about to end first: on a busy machine a structured
        # row may still wait for its grammar (a CI run saw the late wave finish before the fault). A row cut
        # before its first token is carried over as well.
        every_first = asyncio.ensure_future(asyncio.gather(*(until(first, 1) for first in firsts)))
        late_near_end = asyncio.ensure_future(until(late, SHORT - 4))
        await asyncio.wait([every_first, late_near_end], return_when=asyncio.FIRST_COMPLETED)
        every_first.cancel()
        late_near_end.cancel()
        for s in results.values():
            s.at_fault = len(s.ids)
        await fault()
        await asyncio.wait_for(asyncio.gather(*tasks), WAIT_S)
    return results


@pytest.fixture(scope="module")
def matrix_and_reference(
    eager_server: ServerProcess, model_name: str
) -> tuple[dict[str, dict[str, Any]], dict[tuple[int, str], Stream]]:
    """The rows, and each row run uninterrupted at both lengths (together, as in the staged batches):
    ``(max_tokens, row) -> stream``; the seeded row twice (``seeded_again``), to tell whether the engine's
    seeded sampling is reproducible."""

    async def run() -> tuple[dict[str, dict[str, Any]], dict[tuple[int, str], Stream]]:
        async with httpx.AsyncClient(base_url=eager_server.url, timeout=WAIT_S) as client:
            plain = await stream(client, model_name, {"temperature": 0, "ignore_eos": True}, Stream(), SHORT)
            assert plain.error is None and len(plain.ids) == SHORT, plain
            matrix = rows(plain.text[len(plain.text) // 2 :][:3], plain.ids[10], plain.ids[30])
            named = {**named_rows(matrix, "first"), "seeded_again": matrix["seeded"]}
            keys = [(n, name) for n in (SHORT, LONG) for name in named]
            refs = await asyncio.gather(*(stream(client, model_name, named[name], Stream(), n) for n, name in keys))
        return matrix, dict(zip(keys, refs, strict=True))

    matrix, reference = asyncio.run(run())
    for (_, name), ref in reference.items():
        assert ref.error is None and ref.ids, (name, ref)
        check_constraint(name, ref)
    return matrix, reference


def _compare(results: dict[tuple[str, str], Stream], reference: dict[tuple[int, str], Stream], log: str) -> None:
    """Every stream as uninterrupted; ``log``: the server's log over the batch (which requests it re-ran)."""
    failures: dict[str, Any] = {}
    reproducible = reference[(LONG, "seeded")].ids == reference[(LONG, "seeded_again")].ids
    if not (CPU_SAMPLER_KEEPS_SEEDS[VLLM_VERSION] and reproducible):  # seeds dropped in some steps here
        # A seeded stream re-run after sending tokens either reproduced them (the guard checked the seam; what
        # follows is the seeded engine's own, which no reference can predict when a step drops the seed)
        # or ends with the "diverged" error event; one the fault missed (the server's log says which)
        # finishes whole. Any other error fails.
        for wave in WAVES:
            s = results.pop((wave, "seeded"))
            rerun = re.search(rf"request {re.escape(s.rid)} \(\w+\) carried over: re-run after [1-9]", log)
            honest = s.error is None or "diverged" in s.error
            if s.rid == "" or (rerun and not honest) or (not rerun and s.error is not None):
                failures[f"{wave}/seeded"] = f"re-run after tokens: {bool(rerun)}, error event: {s.error}"
    for (wave, name), s in results.items():
        if diff := s.same_as(reference[(WAVES[wave], name)]):
            failures[f"{wave}/{name}"] = (diff, s.error, s.text[:60], reference[(WAVES[wave], name)].text[:60])
    assert not failures, f"differences from the uninterrupted run: {failures}"
    for (_, name), s in results.items():
        check_constraint(name, s)
    # Honest: the fault fell inside the streams (each wave's pacer had sent tokens and had more to send).
    positions = {wave: (results[(wave, "greedy")].at_fault, len(results[(wave, "greedy")].ids)) for wave in WAVES}
    assert all(0 < sent < total for sent, total in positions.values()), positions


def _carried_enough(srv: ServerProcess, before: float, matrix: dict[str, dict[str, Any]]) -> None:
    """The server carried most of the batch's streams over (replayed or resumed or re-run)."""
    carried = carried_over(srv) - before
    assert carried >= 3 * len(matrix) // 2, f"only {carried:g} requests carried over: the fault missed the batch"


def _interrupted(
    srv: ServerProcess,
    model: str,
    matrix_and_reference: tuple[dict[str, dict[str, Any]], dict[tuple[int, str], Stream]],
    fault: Callable[[Callable[[], None]], Awaitable[None]],
) -> None:
    """The staged batch with slow steps, crawling from the first wave's start until ``fault(release)`` has
    landed (a kill at once; a poison's fault at its admission, a step or more after it is sent, which then
    calls ``release()``), then at full speed; every stream compared with the uninterrupted run and most of
    the batch carried over."""
    matrix, reference = matrix_and_reference
    carried = carried_over(srv)
    offset = len(srv.log_path.read_bytes())
    slow = slow_steps_flag(srv)

    def crawl() -> None:
        slow.write_text(str(CRAWL_STEP_S))

    def release() -> None:
        slow.unlink(missing_ok=True)

    async def then_full_speed() -> None:
        try:
            await fault(release)
        finally:
            release()

    slow.touch()
    try:
        results = asyncio.run(staged_batch(srv, model, matrix, crawl, then_full_speed))
    finally:
        slow.unlink(missing_ok=True)
    _compare(results, reference, srv.log_path.read_bytes()[offset:].decode(errors="replace"))
    _carried_enough(srv, carried, matrix)


def test_streams_carried_over_a_kill_answer_as_uninterrupted(
    eager_server: ServerProcess,
    model_name: str,
    matrix_and_reference: tuple[dict[str, dict[str, Any]], dict[tuple[int, str], Stream]],
) -> None:
    core = engine_core(eager_server)

    async def kill(release: Callable[[], None]) -> None:
        core.send_signal(signal.SIGKILL)

    _interrupted(eager_server, model_name, matrix_and_reference, kill)
    poll(lambda: httpx.get(eager_server.url + "/ready").status_code == 200, 300, "ready again")


def test_streams_carried_over_a_soft_recovery_answer_as_uninterrupted(
    eager_server: ServerProcess,
    model_name: str,
    matrix_and_reference: tuple[dict[str, dict[str, Any]], dict[tuple[int, str], Stream]],
) -> None:
    before = labelled(eager_server, "vlguard_engine_recoveries_total", "kind")
    poison = {"model": model_name, "max_tokens": 4,
              "messages": [{"role": "user", "content": f"Carry-over check{EAGER_ADMIT_WORD} now."}]}  # fmt: skip
    refusal: list[httpx.Response] = []

    async def soft_fault(release: Callable[[], None]) -> None:
        """The poison's first fault lands while the engine crawls; its isolated re-run (the second fault)
        waits for the batch to end, at full speed."""
        async with httpx.AsyncClient(base_url=eager_server.url, timeout=WAIT_S) as client:
            answer = asyncio.ensure_future(client.post("/v1/chat/completions", json=poison))
            deadline = time.monotonic() + WAIT_S
            while not answer.done() and time.monotonic() < deadline:
                soft = labelled(eager_server, "vlguard_engine_recoveries_total", "kind",
                                (await client.get("/metrics")).text).get("soft", 0)  # fmt: skip
                if soft > before["soft"]:
                    break
                await asyncio.sleep(0.05)
            release()
            refusal.append(await answer)

    _interrupted(eager_server, model_name, matrix_and_reference, soft_fault)
    assert refusal[0].status_code == 400 and "quarantined" in refusal[0].text
    after = labelled(eager_server, "vlguard_engine_recoveries_total", "kind")
    assert (after["soft"] - before["soft"], after.get("rebuild", 0) - before.get("rebuild", 0)) == (2, 0)
