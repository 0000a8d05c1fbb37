import pytest

# The PostgreSQL fixtures (see pg.py); registered here so they load before any test module.
pytest_plugins = ("pg",)


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param
