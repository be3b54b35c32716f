"""Shared fixtures: the tiny model (built once per session) and the real vlguard servers on it that
integration, deployment and observability tests share (one per session, started right after collection
when a collected test uses them, so that they boot while the unit and in-process API tests run).

Every real-engine launch costs ~40 s on this machine, so each configuration is launched once:

- ``server``: vlguard as deployed on a GPU (compiled, patches on, CUDA-graph padding emulated); its first
  request is text-only (CASES C4) and its answer is kept (``first_text``). The OpenAI surface, the
  deepstack backports under padding (C1), compiled == eager (C3), load, fuzz and bench tests use it.
- ``eager_server``: ``--enforce-eager`` (patches on, unpadded): the numerical reference, and the
  server Prometheus scrapes (no padding: a healthy server must raise no alert). Its model runner raises
  on prompts holding ``EAGER_POISON_WORD`` (test fault plugin; no other prompt is affected), for the
  soft-recovery test every lane runs, and its steps are slow while ``slow_steps_flag(eager_server)`` exists.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.servers import SPARE, ServerProcess, SharedServer, engine_env, retire, vlguard_argv, wait_retired

EAGER_POISON_WORD = " Halcyonpetrichormarker"
SLOW_STEPS_ENV = "VLGUARD_TEST_SLOW_STEPS_IF"  # the fault plugin's: each step sleeps while that file exists


def slow_steps_flag(srv: ServerProcess) -> Path:
    """The file whose presence makes every step of ``srv``'s engine slow (25 ms more: the fault plugin)."""
    return Path(srv.env[SLOW_STEPS_ENV])


def token_ids(model: Path, text: str) -> list[int]:
    """``text``'s token ids under ``model``'s tokenizer (no special tokens)."""
    from transformers import AutoTokenizer

    return list(AutoTokenizer.from_pretrained(model).encode(text, add_special_tokens=False))


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The embedded tiny Qwen3-VL at its stable cache path (:func:`server.devmodel_cache.cached_tiny_model`): vLLM's
    compile cache, keyed by the model path, then serves later sessions and CI runs on the machine."""
    from server.devmodel_cache import cached_tiny_model

    return cached_tiny_model()


def _launch(name: str, tiny_model: Path, logs: Path) -> ServerProcess:
    """Start (do not wait for) the session server ``name``: ``server`` or ``eager_server``."""
    if name == "server":
        env = engine_env(VLGUARD_TEST_EMULATE_PADDING="1")
        return SharedServer(vlguard_argv(tiny_model), logs / "vlguard.log", env=env).start()
    poison = ",".join(map(str, token_ids(tiny_model, EAGER_POISON_WORD)))
    env = engine_env(VLGUARD_TEST_POISON_TOKENS=poison, **{SLOW_STEPS_ENV: str(logs / "slow-steps")})
    # A spare: the C5 kill test asserts the rebuild runs in it, and the step-fault tests rebuild too.
    argv = vlguard_argv(tiny_model, "--enforce-eager", *SPARE)
    return ServerProcess(argv, logs / "vlguard-eager.log", env=env).start()


#: Session servers started as soon as collection shows that a test will use them: their start-up (25-50 s
#: each, mostly single-threaded imports and compilation) then overlaps the unit and in-process API tests,
#: which run first (``testpaths``), instead of adding to the run.
_EARLY: dict[str, ServerProcess] = {}
SESSION_SERVERS = ("server", "eager_server")


def pytest_collection_finish(session: pytest.Session) -> None:
    option = session.config.option
    if option.collectonly or option.setupplan or option.showfixtures or option.show_fixtures_per_test:
        return  # nothing will run
    if session.testsfailed:
        return  # collection errors: pytest stops before running anything
    used = {name for item in session.items for name in getattr(item, "fixturenames", ())}
    wanted = [name for name in SESSION_SERVERS if name in used]
    if wanted:
        from server.devmodel_cache import cached_tiny_model

        factory: pytest.TempPathFactory = session.config._tmp_path_factory  # type: ignore[attr-defined]
        for name in wanted:
            _EARLY[name] = _launch(name, cached_tiny_model(), factory.mktemp("logs"))


@pytest.hookimpl(trylast=True)  # after pytest's own, which tears down session fixtures on an interrupt
def pytest_sessionfinish(session: pytest.Session) -> None:
    while _EARLY:  # started early but never used (e.g. the run stopped first)
        retire(_EARLY.popitem()[1])
    wait_retired()  # every server a fixture retired is gone before pytest exits


def _session_server(name: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> ServerProcess:
    """The early-started server ``name`` (or a new one), waited for until ready."""
    srv = _EARLY.pop(name, None) or _launch(name, tiny_model, tmp_path_factory.mktemp("logs"))
    try:
        srv.wait_ready()
    except BaseException:
        srv.stop()
        raise
    return srv


@pytest.fixture(scope="session")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedServer]:
    """``vlguard serve`` (compiled, patches on) on the tiny model, CUDA-graph padding emulated, on a free
    loopback port; its first request was text-only (``first_text`` is the answer)."""
    from openai import OpenAI

    from tests.integration.outputs import TEXT_PROMPT, greedy

    srv = _session_server("server", tiny_model, tmp_path_factory)
    try:
        assert isinstance(srv, SharedServer)
        with OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
            srv.first_text = greedy(client, str(tiny_model), TEXT_PROMPT)
        yield srv
    finally:
        retire(srv)


@pytest.fixture(scope="session")
def eager_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """``vlguard serve --enforce-eager`` (patches on) on the tiny model: the numerical reference."""
    srv = _session_server("eager_server", tiny_model, tmp_path_factory)
    try:
        yield srv
    finally:
        retire(srv)


@pytest.fixture
def openai_client(server: ServerProcess):  # type: ignore[no-untyped-def]
    from openai import OpenAI

    with OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client


@pytest.fixture(scope="session")
def model_name(tiny_model: Path) -> str:
    return str(tiny_model)
