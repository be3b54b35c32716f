"""Experiment: can N API processes outlive their engine core, as `--api-server-count N` through the guard needs?

The layout is the one `vllm serve --api-server-count N` uses. An owner process launches the engine core with
vLLM's own `launch_core_engines(vllm_config, executor, log_stats, addresses, N)`. Each of N API processes
builds an `AsyncLLM` on its pair of addresses (`client_addresses`, `client_count`, `client_index`). Then:
  1. every API process serves greedy requests;
  2. the owner SIGKILLs the engine core: does an API process notice on its own?
  3. the owner launches a new engine core on new addresses, and each API process builds a new `AsyncLLM` on
     them: are the answers the same?

Plain vLLM: no vlguard plugins, text prompts, no processor cache. Run from the repository with a lane's
interpreter (about 3 minutes on 2 CPUs):

    VLLM_PLUGINS= VLLM_CPU_KVCACHE_SPACE=1 TORCH_COMPILE_DISABLE=1 \
        $(scripts/venv.sh 0.20.0) docs/experiments/api_reconnect.py <tiny model dir>

What it printed (vLLM 0.20.0 CPU, 2026-12-06) is in docs/architecture.md, "Scaling out the API tier".
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

N = 2  # API processes


def engine_args(model: str, rank: int) -> Any:
    """The engine arguments of API process ``rank`` (-1: the owner), as vLLM's launcher sets them."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    args = AsyncEngineArgs(model=model, enforce_eager=True, max_model_len=1024, max_num_seqs=8, dtype="float32",
                           mm_processor_cache_gb=0, seed=0, disable_log_stats=True)  # fmt: skip
    args._api_process_count, args._api_process_rank = N, rank
    return args


def api_process(model: str, index: int, conn: Connection) -> None:
    """Per engine generation the owner announces: build a client, serve 3 greedy requests, report them;
    once told the engine was killed, try one more request (5 s at most), report how it ended, shut down."""
    from vllm import SamplingParams
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    config = engine_args(model, index).create_engine_config(UsageContext.OPENAI_API_SERVER)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)

    async def one_more(llm: Any, request_id: str) -> None:
        async for _ in llm.generate({"prompt_token_ids": [5, 6]}, greedy, request_id):
            pass

    async def serve() -> None:
        while (message := conn.recv()) is not None:
            generation, addresses = message
            started = time.monotonic()
            llm = AsyncLLM.from_vllm_config(config, usage_context=UsageContext.OPENAI_API_SERVER,
                                            client_addresses=addresses, client_count=N, client_index=index)  # fmt: skip
            connected_s = round(time.monotonic() - started, 2)
            answers = []
            for k in range(3):
                async for out in llm.generate({"prompt_token_ids": [1, 2, 3, 4 + index]}, greedy, f"{generation}-{k}"):
                    last = out
                answers.append(list(last.outputs[0].token_ids))
            conn.send(("served", generation, index, connected_s, answers))
            assert conn.recv() == "killed"

            try:
                await asyncio.wait_for(one_more(llm, f"{generation}-dead"), 5)
                ended = "served"
            except BaseException as e:  # what it raises (or a time-out) is the finding
                ended = type(e).__name__
            conn.send(("after the kill", generation, index, ended, "errored" if llm.errored else "not errored"))
            llm.shutdown()

    asyncio.run(serve())


def main(model: str) -> None:
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.utils import CoreEngineProcManager, get_engine_zmq_addresses, launch_core_engines
    from vllm.v1.executor import Executor

    config = engine_args(model, -1).create_engine_config(UsageContext.OPENAI_API_SERVER)
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(N)]
    procs = [ctx.Process(target=api_process, args=(model, i, pipes[i][1]), daemon=True) for i in range(N)]
    for proc in procs:
        proc.start()
    for generation in (1, 2):
        started = time.monotonic()
        new = get_engine_zmq_addresses(config, N)  # a new pair per API process for each engine
        with launch_core_engines(config, Executor.get_class(config), False, new, N) as (manager, _, addresses, queue):
            pass
        assert isinstance(manager, CoreEngineProcManager)  # local engine processes (not Ray actors)
        print(f"owner: engine {generation} up in {time.monotonic() - started:.1f} s", flush=True)
        for i, (owner_end, _) in enumerate(pipes):
            pair = {"input_address": addresses.inputs[i], "output_address": addresses.outputs[i]}
            owner_end.send((generation, {**pair, "tensor_queue": queue} if queue is not None else pair))
        for owner_end, _ in pipes:
            print("owner got", owner_end.recv(), flush=True)
        for core in manager.processes:
            core.kill()
            core.join(30)
        for owner_end, _ in pipes:
            owner_end.send("killed")
        for owner_end, _ in pipes:
            print("owner got", owner_end.recv(), flush=True)
        manager.shutdown()
    for owner_end, _ in pipes:
        owner_end.send(None)
    for proc in procs:
        proc.join(60)
    print("owner: API processes exited", [proc.exitcode for proc in procs], flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
