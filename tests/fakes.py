"""A fake engine for unit tests of vlguard's own logic (supervisor, engine client, HTTP layer).

:class:`FakeEngine` has the surface the supervisor and the engine client use on vLLM's ``AsyncLLM``
(``generate``, ``abort``, ``errored``, ``reset_mm_cache``, ``shutdown``, ``renderer``) and yields real
``vllm.outputs.RequestOutput`` objects. The test decides when it dies, hangs or is slow:

* ``die()``: every pending and later ``generate()`` raises vLLM's ``EngineDeadError``, as when the
  engine core is killed;
* ``pause()`` / ``resume()``: steps stop (a hang, or a slow engine) until resumed;
* ``die_after(n)``: the engine dies once it has produced ``n`` more tokens (a death mid-stream);
* a *poison* token sequence in a prompt kills the engine at that request's first step (a fault tied to
  one input, like the test fault plugin's ``VLGUARD_TEST_POISON_TOKENS``), and the fake records it the
  way vLGuard's fatal recorder does in a real engine core: a ``fatal-*.json`` naming the requests of the
  failing step (every request inside the fake at that moment: its batch) in the directory the supervisor
  set in ``VLGUARD_STATE_DIR`` before the build. ``die()`` records nothing, like a SIGKILL;
* with ``receiver=True`` the fake keeps an engine core's processor cache (the hashes of the processed
  images it received with their data): an image sent without data (``None``) that it does not hold
  finishes the request with ``ERROR`` and no token, as vLLM's receiver cache miss does;
* with ``soft=True`` the poison is absorbed instead, as a real engine core with soft recovery does
  (:mod:`server.engine.soft`): a ``soft-*.json`` record, and every request inside the fake ends with an
  ``ERROR`` finish and no tokens; the engine lives on.

Tokens are a pure function of the token ids so far (greedy and deterministic), so a stream resumed on a
new engine from the tokens already sent must continue exactly as an uninterrupted one.

:class:`FakeEngineFactory` builds them for the supervisor; the test can make builds fail or block.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from collections.abc import AsyncGenerator, Iterable
from pathlib import Path
from typing import Any

VOCAB = 1000


def next_token(ids: list[int]) -> int:
    """The fake model's greedy next token after ``ids``."""
    return (sum(ids) * 31 + len(ids) * 7) % VOCAB


def greedy_tokens(prompt_ids: list[int], n: int) -> list[int]:
    """What an uninterrupted greedy run of ``n`` tokens gives."""
    ids, out = list(prompt_ids), []
    for _ in range(n):
        out.append(next_token(ids))
        ids.append(out[-1])
    return out


def _error_finish(request_id: str, ids: list[int], text: str = "", tokens: list[int] | None = None) -> Any:
    """A request's last output when the engine finished it with ``ERROR``: its ``tokens`` and ``text``
    (a finished output releases the characters vLLM holds back while a stop string may match)."""
    from vllm.outputs import CompletionOutput, RequestOutput

    done = CompletionOutput(index=0, text=text, token_ids=tokens or [], cumulative_logprob=None, logprobs=None,
                            finish_reason="error")  # fmt: skip
    return RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=ids, prompt_logprobs=None,
                         outputs=[done], finished=True)  # fmt: skip


def _beyond_msgpack(value: Any) -> bool:
    """Whether ``value`` holds an integer msgpack cannot encode (outside -2**63 .. 2**64 - 1)."""
    if isinstance(value, dict):
        return any(_beyond_msgpack(v) for v in value.values())
    if isinstance(value, list | tuple):
        return any(_beyond_msgpack(v) for v in value)
    return isinstance(value, int) and not -(2**63) <= value < 2**64


class FakeEngine:
    """One engine life. Build it through :class:`FakeEngineFactory` (or directly in a running loop).

    Arguments:
        generation: which build this is (1 for the first).
        poison: a token id sequence that kills the engine at the first step of a request whose prompt
            holds it (contiguous); empty: no poison.
        renderer: what ``engine.renderer`` returns (the serving layer's tokenizer and processor owner).
        extra: further attributes (``model_config``, ``input_processor``, ...) the serving layer reads.
    """

    def __init__(
        self,
        generation: int = 1,
        poison: Iterable[int] = (),
        renderer: object | None = None,
        fatal_dir: str | None = None,
        soft: bool = False,
        receiver: bool = False,
        **extra: Any,
    ) -> None:
        self.generation = generation
        self.soft = soft
        self.receiver = receiver
        self.held: set[str] = set()  # receiver=True: hashes of the processed images this engine core holds
        self.soft_faults = 0
        self._cut: set[str] = set()  # requests a soft recovery finished with ERROR, not yet told
        self.fatal_dir = fatal_dir
        self.active: set[str] = set()  # request ids inside generate() now: the fake's batch
        self.poison = tuple(poison)
        self._tokens_left: int | None = None  # die_after()
        self._pause_left: int | None = None  # pause_after()
        self.renderer = renderer if renderer is not None else object()
        self.errored = False
        self.shut_down = False
        self.requests: list[str] = []  # request ids, in the order generate() was called
        self.prompts: dict[str, list[int]] = {}  # request id -> prompt token ids as submitted
        self.inputs: dict[str, Any] = {}  # request id -> the engine input as submitted
        self.sampling: dict[str, Any] = {}  # request id -> the sampling parameters as submitted
        self.aborted: list[str] = []
        self.mm_cache_resets = 0
        self._running = asyncio.Event()
        self._running.set()
        self._dead = asyncio.Event()
        self._arrived = asyncio.Event()  # replaced at every generate() call
        self.engine_core = _FakeEngineCore(self)
        for name, value in extra.items():
            setattr(self, name, value)

    # -- what the test controls ----------------------------------------------------------------------
    def die(self) -> None:
        """The engine dies: pending and later ``generate()`` calls raise ``EngineDeadError``."""
        self.errored = True
        self._dead.set()

    def die_after(self, tokens: int) -> None:
        """Die once ``tokens`` more tokens have been produced (by any request)."""
        self._tokens_left = tokens

    def pause_after(self, tokens: int) -> None:
        """:meth:`pause` once ``tokens`` more tokens have been produced (by any request)."""
        self._pause_left = tokens

    def _poisoned(self, ids: list[int]) -> bool:
        n = len(self.poison)
        return n > 0 and any(tuple(ids[i : i + n]) == self.poison for i in range(len(ids) - n + 1))

    def pause(self) -> None:
        """Stop producing output (a hung or very slow engine) until :meth:`resume`."""
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    async def wait_for_requests(self, n: int) -> None:
        """Wait until ``generate()`` was called ``n`` times (probes included)."""
        while len(self.requests) < n:
            arrived = self._arrived
            await arrived.wait()

    # -- the engine surface --------------------------------------------------------------------------
    async def generate(self, prompt: Any, sampling_params: Any, request_id: str, **_: Any) -> AsyncGenerator[Any, None]:
        """Yield one ``RequestOutput`` per token (delta or cumulative, as ``sampling_params`` asks).

        Raises:
            EngineDeadError: the engine died before or while serving this request.
        """
        ids = list(prompt["prompt_token_ids"]) if isinstance(prompt, dict) else [len(str(prompt))]
        if _beyond_msgpack(getattr(sampling_params, "extra_args", None)):
            # What AsyncLLM raises when the engine-core client cannot serialise the request (msgspec).
            from vllm.v1.engine.exceptions import EngineGenerateError

            def add_request() -> None:  # where AsyncLLM's engine-core client serialises the request
                raise OverflowError("can't serialize ints < -2**63 or > 2**64 - 1")

            try:
                add_request()
            except OverflowError as exc:
                raise EngineGenerateError() from exc
        self.inputs[request_id] = prompt
        self.sampling[request_id] = sampling_params
        if self.receiver and not self._receive(prompt):
            yield _error_finish(request_id, ids)
            return
        self.active.add(request_id)
        try:
            async for output in self._generate(ids, sampling_params, request_id):
                yield output
        finally:
            self.active.discard(request_id)

    def _receive(self, prompt: Any) -> bool:
        """The receiver cache's part of adding a request: False when an image came without data and is not
        held (the request then fails); otherwise the images that came with data are held from now on."""
        if not isinstance(prompt, dict) or "mm_kwargs" not in prompt:
            return True
        hashes = prompt["mm_hashes"]
        pairs = [pair for m, items in prompt["mm_kwargs"].items() for pair in zip(items, hashes[m], strict=True)]
        if any(item is None and h not in self.held for item, h in pairs):
            return False
        self.held |= {h for item, h in pairs if item is not None}
        return True

    def _record_step_exception(self, type_name: str, message: str) -> None:
        """What a real engine core's fatal recorder writes when a step raises (engine-side ids carry a suffix)."""
        if self.fatal_dir is None:
            return
        step = sorted(f"{rid}-fake0000" for rid in self.active)
        record = {"type": type_name, "message": message, "step_requests": step, "new_requests": step}
        (Path(self.fatal_dir) / f"fatal-{self.generation}.json").write_text(json.dumps(record))

    def _absorb_step_exception(self) -> None:
        """What a real engine core's soft recovery does: record the fault, cut every request inside."""
        assert self.fatal_dir is not None
        self.soft_faults += 1
        step = sorted(f"{rid}-fake0000" for rid in self.active)
        record = {"type": "RuntimeError", "message": "vlguard test fault: poison request reached the model",
                  "step_requests": step, "new_requests": step, "cut": step, "recovery_s": 0.001}  # fmt: skip
        (Path(self.fatal_dir) / f"soft-{self.generation}-{self.soft_faults}.json").write_text(json.dumps(record))
        self._cut |= self.active

    async def _generate(self, ids: list[int], sampling_params: Any, request_id: str) -> AsyncGenerator[Any, None]:
        from vllm.outputs import CompletionOutput, RequestOutput
        from vllm.sampling_params import RequestOutputKind
        from vllm.v1.engine.exceptions import EngineDeadError

        self.requests.append(request_id)
        self.prompts[request_id] = ids
        arrived, self._arrived = self._arrived, asyncio.Event()
        arrived.set()
        delta = sampling_params.output_kind == RequestOutputKind.DELTA
        max_tokens = sampling_params.max_tokens or 16
        hold = getattr(sampling_params, "output_text_buffer_length", 0)  # held back while a stop may match
        out: list[int] = []
        text, shown = "", 0  # the whole output text; the characters a delta output handed out so far
        for step in range(max_tokens):
            await self._step()
            if self._dead.is_set():
                raise EngineDeadError()
            if step == 0 and self._poisoned(ids) and self.soft:
                self._absorb_step_exception()
            if request_id in self._cut:
                self._cut.discard(request_id)
                if out:  # as a real engine's: the last step's output, not yet read, merged into the finish
                    out.append(next_token(ids + out))
                    text += f" t{out[-1]}"
                tokens = out[-1:] if delta else list(out)
                yield _error_finish(request_id, ids, text[shown:] if delta else text, tokens)
                return
            if step == 0 and self._poisoned(ids):
                self._record_step_exception("RuntimeError", "vlguard test fault: poison request reached the model")
                self.die()
                raise EngineDeadError()
            if self._tokens_left is not None:
                if self._tokens_left == 0:
                    self.die()
                    raise EngineDeadError()
                self._tokens_left -= 1
            out.append(next_token(ids + out))
            if self._pause_left is not None:
                self._pause_left -= 1
                if self._pause_left <= 0:
                    self._pause_left = None
                    self.pause()
            finished = len(out) == max_tokens
            new = out[-1:] if delta else list(out)
            text += f" t{out[-1]}"
            visible = len(text) if finished else max(0, len(text) - hold)
            completion = CompletionOutput(
                index=0,
                text=text[shown:visible] if delta else text[:visible],
                token_ids=new,
                cumulative_logprob=None,
                logprobs=None,
                finish_reason="length" if finished else None,
            )
            shown = max(shown, visible)
            yield RequestOutput(
                request_id=request_id,
                prompt=None,
                prompt_token_ids=ids,
                prompt_logprobs=None,
                outputs=[completion],
                finished=finished,
            )

    async def _step(self) -> None:
        if not self._running.is_set() and not self._dead.is_set():
            waits = [asyncio.ensure_future(self._running.wait()), asyncio.ensure_future(self._dead.wait())]
            _, pending = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()
        await asyncio.sleep(0)  # let other requests step too

    async def abort(self, request_id: str | Iterable[str]) -> None:
        self.aborted += [request_id] if isinstance(request_id, str) else list(request_id)

    def check_admission(self, n: int = 1, request_id: str | None = None) -> None:
        """vLLM >= 0.32 asks the engine client before rendering; the fake admits everything."""

    async def reset_mm_cache(self) -> None:
        self.mm_cache_resets += 1
        self.held.clear()

    def shutdown(self) -> None:
        self.shut_down = True
        self.die()


class _FakeEngineCore:
    """``engine.engine_core``: what the supervisor shuts down when it tears a dead or hung engine down."""

    def __init__(self, engine: FakeEngine) -> None:
        self._engine = engine

    def shutdown(self) -> None:
        self._engine.shut_down = True
        self._engine.die()

    async def get_output_async(self) -> None:
        """What ``AsyncLLM``'s output handler awaits for each step's outputs; tests call it to stand for
        an engine core that is stepping (the supervisor wraps it as its hang-clock signal)."""


class FakeEngineFactory:
    """Builds :class:`FakeEngine` s for a supervisor (called off the event loop, like the real build).

    Arguments:
        poison: passed to every engine.
        fail: how many of the next builds raise ``RuntimeError`` (a start-up that keeps failing).
        engine_kwargs: more arguments for every :class:`FakeEngine`.
    """

    def __init__(self, poison: Iterable[int] = (), fail: int = 0, **engine_kwargs: Any) -> None:
        self.poison = tuple(poison)
        self.fail = fail
        self.engine_kwargs = engine_kwargs
        self.engines: list[FakeEngine] = []
        self.attempts = 0
        #: Cleared: builds block until the test sets it (an engine that is still loading).
        self.gate = threading.Event()
        self.gate.set()
        self.building = threading.Event()  # set while a build waits at the gate

    def __call__(self) -> FakeEngine:
        self.attempts += 1
        self.building.set()
        try:
            self.gate.wait(60)
        finally:
            self.building.clear()
        if self.fail > 0:
            self.fail -= 1
            raise RuntimeError(f"fake engine build {self.attempts} failed")
        # The supervisor names this engine's fatal-record directory in the environment before each build.
        engine = FakeEngine(len(self.engines) + 1, self.poison, fatal_dir=os.environ.get("VLGUARD_STATE_DIR"),
                            **self.engine_kwargs)  # fmt: skip
        self.engines.append(engine)
        return engine

    @property
    def current(self) -> FakeEngine:
        """The engine built last."""
        return self.engines[-1]


class GuardHarness:
    """A supervisor over fake engines (``factory``), with its engine client, a manual clock, the backoffs
    it slept and the times it gave up: the one harness of the guard's unit tests. Start it with
    ``await h.sup.start()``; shut it down with ``await h.sup.shutdown()``.

    Arguments:
        settings: :class:`GuardSettings` fields over the harness's defaults (no watchdog ticks, a 1 s
            backoff, holds bounded by ``wait_s``).
        forensics: a :class:`server.guard.forensics.Forensics` for the supervisor, or None.
    """

    def __init__(
        self, factory: FakeEngineFactory, wait_s: float = 10.0, forensics: Any = None, **settings: Any
    ) -> None:
        from server.guard.engine_client import GuardedEngineClient
        from server.guard.supervisor import Supervisor
        from server.settings import GuardSettings
        from tests.helpers import ManualClock

        defaults: dict[str, Any] = {"watchdog_interval": 3600, "restart_backoff": 1.0, "hold_timeout": wait_s}
        self.wait_s = wait_s
        self.settings = GuardSettings(**{**defaults, **settings})
        self.factory = factory
        self.clock = ManualClock()
        self.slept: list[float] = []
        self.failed_calls = 0
        self.sup = Supervisor(
            factory, self.settings, on_failed=self._on_failed, clock=self.clock, sleep=self._sleep, forensics=forensics
        )
        self.client = GuardedEngineClient(self.sup)

    def _on_failed(self) -> None:
        self.failed_calls += 1

    async def _sleep(self, seconds: float) -> None:
        self.slept.append(seconds)

    async def state(self, *states: Any) -> Any:
        """Wait (at most ``wait_s``) until the supervisor's state is one of ``states``."""
        return await asyncio.wait_for(self.sup.states.wait_for(*states), self.wait_s)

    async def collect(
        self,
        prompt: list[int] | dict[str, Any],
        max_tokens: int = 4,
        stream: bool = False,
        rid: str = "r",
        no_error: bool = False,
    ) -> list[int]:
        """The token ids the engine client answers for ``prompt`` (token ids, or a whole prompt dict), greedy;
        ``no_error``: fail on an ``error`` finish."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(max_tokens=max_tokens, temperature=0)
        if stream:
            params.output_kind = RequestOutputKind.DELTA
        tokens: list[int] = []
        request = {"prompt_token_ids": prompt} if isinstance(prompt, list) else prompt
        async for out in self.client.generate(request, params, rid):
            assert not (no_error and out.outputs[0].finish_reason == "error"), rid
            tokens = [*tokens, *out.outputs[0].token_ids] if stream else list(out.outputs[0].token_ids)
        return tokens
