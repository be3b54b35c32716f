"""Which engine errors are the request's (server.guard.errors): only what vLLM raised while adding it."""

from __future__ import annotations

from server.guard.errors import UnsendableRequestError


def _raised(in_function: str, exc: BaseException) -> BaseException:
    def add_request() -> None:
        raise exc

    def output_handler() -> None:
        raise exc

    try:
        (add_request if in_function == "add_request" else output_handler)()
    except BaseException as caught:
        return caught
    raise AssertionError("not raised")


def test_a_type_error_adding_the_request_is_the_clients_and_the_same_from_the_output_handler_is_not() -> None:
    mine = UnsendableRequestError.of(_raised("add_request", OverflowError("can't serialize ints > 2**64 - 1")))
    assert mine is not None and mine.status == 400 and "OverflowError: can't serialize" in str(mine)
    assert UnsendableRequestError.of(_raised("output_handler", TypeError("bad"))) is None  # every request's
    assert UnsendableRequestError.of(_raised("add_request", RuntimeError("zmq"))) is None  # not the request's kind
    assert UnsendableRequestError.of(None) is None
