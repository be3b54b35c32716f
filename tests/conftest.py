"""Shared fixtures: the tiny model (built once per session) and the real vlguard servers on it that
integration, deployment and observability tests share (one per session, started right after collection
when a collected test uses them, so that they boot while the unit and in-process API tests run). The
Docker engine tests' image is built from then on too (:mod:`tests.docker_image`).

Every real-engine launch costs ~40 s on this machine, so each configuration is launched once:

- ``server``: vlguard as deployed on a GPU (compiled, patches on, CUDA-graph padding emulated); its first
  request is text-only (CASES C4) and its answer is kept (``first_text``). The OpenAI surface, the
  deepstack backports under padding (C1), compiled == eager (C3), load, fuzz and bench tests use it.
- ``eager_server``: ``--enforce-eager`` (patches on, unpadded): the numerical reference, and the
  server Prometheus scrapes (no padding: a healthy server must raise no alert). Its model runner raises
  on prompts holding ``EAGER_POISON_WORD`` and its scheduler on admitting ``EAGER_ADMIT_WORD`` (test fault
  plugin; no other prompt is affected), for the soft-recovery tests every lane runs, and its steps are
  slow while ``slow_steps_flag(eager_server)`` exists. It keeps forensic records (``forensics_dir``) and
  opens its operator routes with ``OPERATOR_KEY``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.docker_image import ImageBuild, docker_answers
from tests.notify import NotifySocket
from tests.servers import SPARE, ServerProcess, SharedServer, engine_env, retire, vlguard_argv, wait_retired
from tests.suites import HALF_ENV, in_half, marks_lane

EAGER_POISON_WORD = " Halcyonpetrichormarker"
EAGER_ADMIT_WORD = " Gossamerquincemarker"  # the scheduler raises admitting it (a fault outside any model step)
SLOW_STEPS_ENV = "VLGUARD_TEST_SLOW_STEPS_IF"  # the fault plugin's: each step sleeps while that file exists
DROP_MM_CACHE_ENV = "VLGUARD_TEST_DROP_MM_CACHE_IF"  # the fault plugin's: engine-side image cache emptied
FORENSICS_ENV = "VLGUARD_FORENSICS_DIR"  # --guard-forensics-dir


def slow_steps_flag(srv: ServerProcess) -> Path:
    """The file whose presence makes every step of ``srv``'s engine slow (25 ms more, or the seconds written
    into it: the fault plugin)."""
    return Path(srv.env[SLOW_STEPS_ENV])


def forensics_dir(srv: ServerProcess) -> Path:
    """Where ``srv`` writes its forensic records (``--guard-forensics-dir``)."""
    return Path(srv.env[FORENSICS_ENV])


def drop_mm_cache_flag(srv: ServerProcess) -> Path:
    """The file whose presence makes ``srv``'s engine core empty its image cache before each request."""
    return Path(srv.env[DROP_MM_CACHE_ENV])


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


#: Starts (does not wait for) a server: ``launcher(tiny_model, logs_dir)``.
Launcher = Callable[[Path, Path], ServerProcess]


#: The shared ``server``'s operator key (its /admin routes are closed without one).
OPERATOR_KEY = "test-operator-key"


def _launch_server(tiny_model: Path, logs: Path) -> ServerProcess:
    env = engine_env(VLGUARD_TEST_EMULATE_PADDING="1", VLGUARD_OPERATOR_KEY=OPERATOR_KEY)
    return SharedServer(vlguard_argv(tiny_model), logs / "vlguard.log", env=env).start()


def _launch_eager_server(tiny_model: Path, logs: Path) -> ServerProcess:
    poison = ",".join(map(str, token_ids(tiny_model, EAGER_POISON_WORD)))
    flags = {SLOW_STEPS_ENV: str(logs / "slow-steps"), DROP_MM_CACHE_ENV: str(logs / "drop-mm-cache")}
    admit = ",".join(map(str, token_ids(tiny_model, EAGER_ADMIT_WORD)))
    flags |= {FORENSICS_ENV: str(logs / "forensics"), "VLGUARD_OPERATOR_KEY": OPERATOR_KEY}
    env = engine_env(VLGUARD_TEST_POISON_TOKENS=poison, VLGUARD_TEST_POISON_ADMIT_TOKENS=admit, **flags)
    # A spare: the C5 kill test asserts the rebuild runs in it, and the step-fault tests rebuild too.
    argv = vlguard_argv(tiny_model, "--enforce-eager", *SPARE)
    return ServerProcess(argv, logs / "vlguard-eager.log", env=env).start()


#: Servers started as soon as collection shows that a test will use them: their start-up (25-50 s each, 90 s
#: compiled; mostly single-threaded imports and compilation) then overlaps the unit and in-process API
#: tests, which run first (``testpaths``), instead of adding to the run. Keys are fixture names, with
#: ``[param]`` for a parametrized fixture; a test module declares its own servers' launchers in
#: ``EARLY_LAUNCHERS``. In this order, and at most :data:`MAX_EARLY` of them with the Docker image build
#: counted as one (its container): each idle server holds ~3 GB of the machine's 24 while the deployment
#: tests run servers of their own.
EARLY_ORDER = ("server", "eager_server", "compiled_stock", "padded_stock", "aligned_unpatched[chunked]")
MAX_EARLY = int(os.environ.get("VLGUARD_TEST_MAX_EARLY", "4"))
_LAUNCHERS: dict[str, Launcher] = {"server": _launch_server, "eager_server": _launch_eager_server}
_EARLY: dict[str, ServerProcess] = {}
#: vlguard's Docker image, likewise built from the end of collection when the Docker engine tests will run.
_EARLY_IMAGE: list[ImageBuild] = []


def early_image_build() -> ImageBuild | None:
    """The image build started at the end of collection, if any (handed out once)."""
    return _EARLY_IMAGE.pop() if _EARLY_IMAGE else None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if marks_lane(Path(item.path)):
            item.add_marker(pytest.mark.lane)
    if half := os.environ.get(HALF_ENV):  # one half of the default lane (tests/suites.py, OWN_SERVERS)
        drop = [item for item in items if not in_half(Path(item.path), half)]
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = [item for item in items if in_half(Path(item.path), half)]


def pytest_collection_finish(session: pytest.Session) -> None:
    option = session.config.option
    if option.collectonly or option.setupplan or option.showfixtures or option.show_fixtures_per_test:
        return  # nothing will run
    if session.testsfailed:
        return  # collection errors: pytest stops before running anything
    used: set[str] = set()
    launchers = dict(_LAUNCHERS)
    for item in session.items:
        if _skipped(item):
            continue
        launchers.update(getattr(getattr(item, "module", None), "EARLY_LAUNCHERS", {}))
        params = getattr(getattr(item, "callspec", None), "params", {})
        used.update(f"{name}[{params[name]}]" if name in params else name for name in getattr(item, "fixturenames", ()))
    factory: pytest.TempPathFactory = session.config._tmp_path_factory  # type: ignore[attr-defined]
    budget = MAX_EARLY
    if "vlguard_image" in used and docker_answers():  # else the fixture fails at once, saying why
        import vllm

        _EARLY_IMAGE.append(ImageBuild.start(vllm.__version__, factory.mktemp("image") / "build.log"))
        budget -= 1
    wanted = [key for key in EARLY_ORDER if key in used and key in launchers][:budget]
    if wanted:
        from server.devmodel_cache import cached_tiny_model

        for key in wanted:
            _EARLY[key] = launchers[key](cached_tiny_model(), factory.mktemp("logs"))


@pytest.hookimpl(trylast=True)  # after pytest's own, which tears down session fixtures on an interrupt
def pytest_sessionfinish(session: pytest.Session) -> None:
    while _EARLY:  # started early but never used (e.g. the run stopped first)
        retire(_EARLY.popitem()[1])
    while _EARLY_IMAGE:
        _EARLY_IMAGE.pop().stop()
    wait_retired()  # every server a fixture retired is gone before pytest exits


def _skipped(item: pytest.Item) -> bool:
    """Whether a ``skipif`` mark with a plain condition skips ``item`` (its fixtures will not be set up)."""
    return any(mark.args and mark.args[0] is True for mark in item.iter_markers("skipif"))


def early_server(
    key: str, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory, launcher: Launcher | None = None
) -> ServerProcess:
    """The early-started server ``key`` (see :data:`EARLY_ORDER`), or a new one from ``launcher`` (default:
    the session servers' own), waited for until ready."""
    srv = _EARLY.pop(key, None) or (launcher or _LAUNCHERS[key])(tiny_model, tmp_path_factory.mktemp("logs"))
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

    srv = early_server("server", tiny_model, tmp_path_factory)
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
    srv = early_server("eager_server", tiny_model, tmp_path_factory)
    try:
        yield srv
    finally:
        retire(srv)


@pytest.fixture
def openai_client(server: ServerProcess):  # type: ignore[no-untyped-def]
    from openai import OpenAI

    with OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def notify(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NotifySocket]:
    """A systemd notify socket for a module's own server (``NOTIFY_SOCKET``), closed after the module."""
    sock = NotifySocket(tmp_path_factory.mktemp("notify") / "notify.sock")
    yield sock
    sock.close()


@pytest.fixture(scope="session")
def model_name(tiny_model: Path) -> str:
    return str(tiny_model)
