import pytest

# The PostgreSQL fixtures (see kit/pg.py); registered here so they load before any test module.
pytest_plugins = ("kit.pg",)

RUN_SLOW = "--run-slow"


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        RUN_SLOW,
        action="store_true",
        help="also run the tests marked slow (subprocess kills, load, lease lapses, the fleet, "
        "the examples and benchmarks); the README's test command and CI pass it",
    )


# Store kinds that write to disk or to a server; see trio_on_a_durable_store below.
DURABLE_STORE_KINDS = frozenset({"jsonl", "sqlite", "postgresql"})


def trio_on_a_durable_store(item: pytest.Item) -> bool:
    """Whether ``item`` runs under Trio on a durable store (a parameter naming its kind).

    Such a case is slow by the rule of research-wiki/0044: its asyncio sibling on the same
    store and its Trio sibling on the memory store (or its Trio cases without a store) stay
    in the quick run, so the quick run still covers each store and each backend.
    """
    params = getattr(item, "callspec", None)
    if params is None or params.params.get("anyio_backend") != "trio":
        return False
    return any(
        isinstance(value, str) and value in DURABLE_STORE_KINDS
        for name, value in params.params.items()
        if name != "anyio_backend"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if trio_on_a_durable_store(item):
            item.add_marker(pytest.mark.slow)
    # Deselected rather than skipped: a skip per slow test would bury the real skips that
    # `-ra` lists; the report header and the summary say how many were left out and why.
    if config.getoption(RUN_SLOW):
        return
    slow = [item for item in items if item.get_closest_marker("slow") is not None]
    if slow:
        config.hook.pytest_deselected(items=slow)
        items[:] = [item for item in items if item.get_closest_marker("slow") is None]
    config.stash[_left_out] = len(slow)


_left_out = pytest.StashKey[int]()


def pytest_report_header(config: pytest.Config) -> str:
    if config.getoption(RUN_SLOW):
        return "slow tests: included"
    return f"slow tests: left out ({RUN_SLOW} includes them)"


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    left_out = config.stash.get(_left_out, 0)
    if left_out:
        terminalreporter.write_line(
            f"{left_out} slow tests were not run; {RUN_SLOW} includes them "
            "(the README's test command does)"
        )
