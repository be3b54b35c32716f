"""Compiled vs ``--enforce-eager`` agreement on the installed vLLM (one engine lane), patches on and off.

Starts three vlguard servers one after the other on the same model and profile: eager (the reference:
eager is correct on every vLLM), compiled with the deepstack backports (``--guard-patches on``) and
compiled without them (``off``). Each answers a text prompt and three photographs greedily with logprobs
(``--tokens`` each, EOS ignored). Printed per prompt: leading tokens equal to eager (of ``--tokens``) and
the largest |logprob difference|; plus the vLLM version and the patches vlguard activated.

Usage: ``python -m server.workload.compile_accuracy MODEL_DIR [--profile config/tiny-cpu.yaml] [--tokens 6]``
(loopback only; each server is stopped before the next starts).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import httpx
from openai import OpenAI

from server.workload.greedy import Greedy, greedy
from server.workload.images import photo_uri
from server.workload.servers import ServerProcess, vlguard_command
from server.workload.twopass import primary_messages

PROMPTS: dict[str, list[dict[str, Any]]] = {
    "text": [{"role": "user", "content": "Describe the safety rules for a construction site."}],
    **{name: primary_messages(photo_uri(name)) for name in ("astronaut.png", "rocket.jpg", "camera.png")},
}
SYSTEMS = {"eager": ["--enforce-eager"], "compiled+patches": ["--guard-patches", "on"],
           "compiled-patches": ["--guard-patches", "off"]}  # fmt: skip


def _outputs(model: str, flags: list[str], profile: Path, tokens: int, log: Path) -> tuple[dict[str, Greedy], Any]:
    srv = ServerProcess(vlguard_command(model, "--config", str(profile), *flags), log).start()
    try:
        srv.wait_ready()
        version = httpx.get(srv.url + "/version", timeout=10).json()
        with OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=300) as client:
            served = client.models.list().data[0].id
            return {name: greedy(client, served, msgs, tokens) for name, msgs in PROMPTS.items()}, version
    finally:
        srv.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--profile", type=Path, default=Path("config/tiny-cpu.yaml"))
    parser.add_argument("--tokens", type=int, default=6)
    parser.add_argument("--out", type=Path, default=Path("bench-out"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results, versions = {}, {}
    for system, flags in SYSTEMS.items():
        log = args.out / f"accuracy-{system}.log"
        results[system], versions[system] = _outputs(args.model, flags, args.profile, args.tokens, log)
    ref = results["eager"]
    vllm_version = versions["eager"]["vllm_version"]
    print(f"vLLM {vllm_version}; patches active when on: {versions['compiled+patches']['patches']['active']}")
    print(f"{'system':18} {'prompt':14} {'tokens = eager':>14} {'max |dlogprob|':>15}")
    table = []
    for system in ("compiled+patches", "compiled-patches"):
        for prompt, out in results[system].items():
            same, diff = out.agreeing_tokens(ref[prompt]), out.max_logprob_diff(ref[prompt])
            print(f"{system:18} {prompt:14} {f'{same}/{args.tokens}':>14} {diff:15.2e}")
            table.append({"system": system, "prompt": prompt, "equal_tokens": same, "max_logprob_diff": diff})
    (args.out / f"compile-accuracy-{vllm_version}.json").write_text(
        json.dumps({"vllm_version": vllm_version, "tokens": args.tokens, "rows": table, "versions": versions}, indent=1)
    )


if __name__ == "__main__":
    main()
