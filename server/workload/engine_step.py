"""``vlguard bench compare --scenario engine``: the engine core's cost per step, vLLM's own against vlguard's.

Three child processes (``python -m server.workload.engine_step SYSTEM MODEL [vllm serve flags]``), each
running vLLM's engine core in-process: ``LLMEngine`` with V1 multiprocessing off and the uni-process
executor, so scheduler, model runner and model share one process and nothing waits on a socket.

- ``vlguard``: what vlguard adds inside the engine core and its worker: its engine arguments
  (:func:`server.serve.engine_overrides`: the aligned scheduler), the deepstack backports (plugin
  ``vlguard_patches``, applied where the installed vLLM needs them), and the step log and soft recovery
  wrapped around the engine core's ``schedule``, ``update_from_output``, ``step_fn`` and ``add_request``
  (:func:`server.engine.step_log.remember_steps`, :func:`server.engine.soft.install`: what vlguard's fatal
  plugin installs in the engine-core process);
- ``stock-a`` and ``stock-b``: vLLM as it is, no plugin: the second is the A/A floor of the same run.

Every child gets the same recorded two-pass step sequence, round by round (fresh images each round): a
round's primary requests added at once and stepped until all finished, then their rescue requests the
same way (greedy, ``ignore_eos``, fixed output length). Rounds rotate the children's order
(:func:`report.rotation`) and the idle children are SIGSTOPped. Each child times every engine-core step
(``step_fn``: schedule, model execution, output update) in CPU time of its whole process (all threads,
OpenMP workers spinning between steps included), CPU time of the thread that runs the engine core, and
wall time. Printed: ms per step of each
system, the ratios vlguard / stock-a and stock-b / stock-a with 90 % bootstrap intervals over
the rounds, and the steps each ran (alignment may split a step differently; on a CPU engine, which pads
nothing, it does not). The processor's work (chat template, image preprocessing) is outside the timing.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from server.vllm_hooks import engine_core
from server.workload import generator, report

SYSTEMS = ("vlguard", "stock-a", "stock-b")
#: The figures of a round, by their index in its row ``(steps, CPU s, main-thread CPU s, wall s)``.
CPU, THREAD, WALL = 1, 2, 3
MEASURES = {CPU: "process CPU", THREAD: "engine-thread CPU", WALL: "wall"}


@dataclass
class EngineStepResult:
    """Per system: each measured round's ``(steps, CPU s, main-thread CPU s, wall s)``: CPU of the whole
    process (every thread: OpenMP workers spinning between steps included), of the thread that runs the
    engine core (scheduler, hooks, the model's Python and its OpenMP master share), and wall time."""

    rounds: dict[str, list[tuple[int, float, float, float]]] = field(default_factory=dict)

    def per_step_ms(self, name: str, index: int) -> float:
        """Mean ms per step over the rounds of the figure at ``index`` (:data:`CPU`, :data:`THREAD`,
        :data:`WALL`)."""
        rows = self.rounds[name]
        return 1000 * sum(r[index] for r in rows) / max(1, sum(r[0] for r in rows))

    def ratio(self, name: str, ref: str, index: int = CPU) -> tuple[float, tuple[float, float]]:
        """``name`` / ``ref`` of the cost per step (figure ``index``) and its 90 % bootstrap interval, rounds
        resampled in pairs (:func:`report.ratio_interval`)."""
        a = [(r[index], r[0]) for r in self.rounds[name]]
        b = [(r[index], r[0]) for r in self.rounds[ref]]
        return self.per_step_ms(name, index) / self.per_step_ms(ref, index), report.ratio_interval(a, b)


# --- the child: one engine core in this process ------------------------------------------------------


def _hf_messages(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """OpenAI chat messages as Hugging Face chat-template messages (image parts become placeholders);
    returns them and the number of images."""
    out, images = [], 0
    for msg in messages:
        parts = msg["content"] if isinstance(msg["content"], list) else [{"type": "text", "text": msg["content"]}]
        content = []
        for part in parts:
            if part["type"] == "image_url":
                content.append({"type": "image"})
                images += 1
            else:
                content.append({"type": "text", "text": part["text"]})
        out.append({"role": msg["role"], "content": content})
    return out, images


class _Child:
    """The engine of one system and the timer around its engine-core steps."""

    def __init__(self, system: str, model: str, serve_args: list[str]) -> None:
        from transformers import AutoProcessor
        from vllm.v1.engine.llm_engine import LLMEngine

        from server.args import resolve_serve_args
        from server.serve import engine_args

        args, settings = resolve_serve_args(["serve", model, *serve_args])
        if system == "vlguard":
            eargs = engine_args(args, settings)
        else:
            from vllm.engine.arg_utils import AsyncEngineArgs

            eargs = AsyncEngineArgs.from_cli_args(args)
        eargs.distributed_executor_backend = "uni"
        self.engine = LLMEngine.from_engine_args(eargs)
        self.processor = AutoProcessor.from_pretrained(model)
        core: Any = self.engine.engine_core.engine_core  # type: ignore[attr-defined]  # InprocClient -> EngineCore
        if system == "vlguard":
            from server.engine import soft, step_log
            from server.engine.protocol import EngineSettings

            log = step_log.remember_steps(core.scheduler, 1)
            soft.install(core, log, soft.SoftPolicy.from_settings(EngineSettings.from_environ()))
        self.steps, self.cpu_s, self.thread_s, self.wall_s = 0, 0.0, 0.0, 0.0
        engine_core.time_steps(core, self._timed)
        self.plan: generator.TwoPassPlan | None = None
        self.seq = 0

    def _timed(self, step: Callable[[], Any]) -> Callable[[], Any]:
        def timed() -> Any:
            cpu, thread, wall = time.process_time(), time.thread_time(), time.perf_counter()
            try:
                return step()
            finally:
                self.cpu_s += time.process_time() - cpu
                self.thread_s += time.thread_time() - thread
                self.wall_s += time.perf_counter() - wall
                self.steps += 1

        return timed

    def _prompt(self, messages: list[dict[str, Any]], image: bytes) -> Any:
        from PIL import Image

        hf, count = _hf_messages(messages)
        text = self.processor.apply_chat_template(hf, tokenize=False, add_generation_prompt=True)
        pil = Image.open(io.BytesIO(image)).convert("RGB")
        return {"prompt": text, "multi_modal_data": {"image": [pil] * count}}

    def _drain(self, prompts: list[Any], max_tokens: int) -> None:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        for prompt in prompts:
            self.seq += 1
            self.engine.add_request(f"step-bench-{self.seq}", prompt, params)
        while self.engine.has_unfinished_requests():
            self.engine.step()

    def round(self, workload: generator.TwoPassConfig, first_pair: int, pairs: int) -> tuple[int, float, float, float]:
        """Run one round (primaries, then rescues); returns its ``(steps, CPU s, thread CPU s, wall s)``."""
        if self.plan is None or self.plan.config != workload:
            self.plan = generator.TwoPassPlan(workload)
        chosen = [self.plan.pair(i) for i in range(first_pair, first_pair + pairs)]
        primaries = [self._prompt(p.primary, p.image) for p in chosen]
        rescues = [self._prompt(p.rescue, p.image) for p in chosen]
        before = (self.steps, self.cpu_s, self.thread_s, self.wall_s)
        self._drain(primaries, workload.max_tokens)
        self._drain(rescues, workload.max_tokens)
        after = (self.steps, self.cpu_s, self.thread_s, self.wall_s)
        return after[0] - before[0], after[1] - before[1], after[2] - before[2], after[3] - before[3]


def child_main(argv: list[str]) -> int:
    """The child's loop: build the engine, say ``ready``, then run each round asked for on stdin (one JSON
    object a line: workload, first_pair, pairs) and answer it on the original stdout. vLLM's own output
    goes to stderr."""
    system, model, *serve_args = argv
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM logs to stdout: keep the answer channel clean
    child = _Child(system, model, serve_args)
    answers.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        ask = json.loads(line)
        workload = generator.TwoPassConfig(**ask["workload"])
        answers.write(json.dumps(child.round(workload, ask["first_pair"], ask["pairs"])) + "\n")
    return 0


# --- the parent: three children in lockstep ------------------------------------------------------------


def _env(system: str) -> dict[str, str]:
    from server.workload.servers import engine_env

    plugins = "vlguard_patches" if system == "vlguard" else ""
    return engine_env(VLLM_PLUGINS=plugins, VLLM_ENABLE_V1_MULTIPROCESSING="0")


def _read(proc: subprocess.Popen[str], timeout_s: float) -> Any:
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the child answers or exits (EOF)
    if not line:
        raise RuntimeError(f"engine-step child exited with {proc.wait(timeout_s)}; see its log")
    return json.loads(line)


def run(
    model: str,
    serve_args: list[str],
    out: Path,
    workload: generator.TwoPassConfig,
    rounds: int = 10,
    warmup: int = 1,
    pairs: int = 8,
    ready_timeout_s: float = 900.0,
) -> EngineStepResult:
    """Run the scenario (module docstring); each child's log is ``out/compare-engine-SYSTEM.log``."""
    procs: dict[str, subprocess.Popen[str]] = {}
    logs: list[IO[bytes]] = []
    log: IO[bytes]
    result = EngineStepResult({name: [] for name in SYSTEMS})
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in workload.__dict__.items()}
    try:
        for name in SYSTEMS:  # one at a time: engines started together bind the same cores
            log = (out / f"compare-engine-{name}.log").open("wb")
            logs.append(log)
            cmd = [sys.executable, "-m", "server.workload.engine_step", name, model, *serve_args]
            procs[name] = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                           env=_env(name), text=True, start_new_session=True)  # fmt: skip
            _read(procs[name], ready_timeout_s)
            os.killpg(procs[name].pid, signal.SIGSTOP)
        for rnd in range(-warmup, rounds):
            ask = {"workload": config, "first_pair": (rnd + warmup) * pairs, "pairs": pairs}
            for name in report.rotation(SYSTEMS, rnd):
                proc = procs[name]
                assert proc.stdin is not None
                os.killpg(proc.pid, signal.SIGCONT)
                proc.stdin.write(json.dumps(ask) + "\n")
                proc.stdin.flush()
                answer = _read(proc, ready_timeout_s)
                os.killpg(proc.pid, signal.SIGSTOP)
                if rnd >= 0:
                    steps, cpu_s, thread_s, wall_s = answer
                    result.rounds[name].append((steps, cpu_s, thread_s, wall_s))
    finally:
        for proc in procs.values():
            os.killpg(proc.pid, signal.SIGCONT)
            if proc.stdin is not None:
                proc.stdin.close()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for log in logs:
            log.close()
    return result


def summary_lines(result: EngineStepResult) -> list[str]:
    """The printed figures."""
    lines = []
    for name in SYSTEMS:
        steps = sum(r[0] for r in result.rounds[name])
        figures = ", ".join(f"{what} {result.per_step_ms(name, i):.3f}" for i, what in MEASURES.items())
        lines.append(f"{name:8} {steps} engine-core steps in {len(result.rounds[name])} rounds, ms per step: {figures}")
    for name, what in (("vlguard", "vlguard / stock-a"), ("stock-b", "A/A floor, stock-b / stock-a")):
        ratios = []
        for i, measure in MEASURES.items():
            ratio, (low, high) = result.ratio(name, "stock-a", i)
            ratios.append(f"{measure} {ratio:.4f} (90 % {low:.4f} to {high:.4f})")
        lines.append(f"{what} per step: " + ", ".join(ratios))
    return lines


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
