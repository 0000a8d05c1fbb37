"""The link templates of ``polyloop serve`` (``--trace-url``, ``--temporal-url``):
checked when the console starts, filled in with a run's own ids on its page."""

from __future__ import annotations

from pathlib import Path

import pytest

from polyloop import run_trace_id
from polyloop.cli import main
from polyloop.cli._common import CliError
from polyloop.cli._console._links import LinkTemplate, parsed


def test_a_template_is_filled_with_the_trace_id_and_the_run_id_as_one_segment() -> None:
    template = LinkTemplate.parse("https://ui.example/t/{trace_id}?w={run_id}", "--trace-url")
    run_id = "ops/deploy 1?#%\u202e"
    assert template.link(run_id) == (
        f"https://ui.example/t/{run_trace_id(run_id)}?w=ops%2Fdeploy%201%3F%23%25%E2%80%AE"
    )
    doubled = LinkTemplate.parse("http://x/{{literal}}/{run_id}", "--temporal-url")
    assert doubled.link("r") == "http://x/{literal}/r"
    assert parsed(None, "--trace-url") is None


@pytest.mark.parametrize(
    ("template", "said"),
    [
        ("https://t/{span_id}", "unknown placeholder {span_id}"),
        ("https://t/{}", "unknown placeholder {}"),
        ("https://t/{0}", "unknown placeholder {0}"),
        ("https://t/{trace_id!r}", "unknown placeholder {trace_id!r}"),
        ("https://t/{trace_id:>40}", "unknown placeholder {trace_id:>40}"),
        ("https://t/{run_id.__class__}", "unknown placeholder {run_id.__class__}"),
        ("https://t/{trace_id", "write a brace as {{ or }}"),
        ("javascript:alert({run_id})", "not an http:// or https:// address"),
        ("tempo.example/{trace_id}", "not an http:// or https:// address"),
    ],
)
def test_a_template_that_is_not_an_address_with_known_placeholders_is_refused(
    template: str, said: str
) -> None:
    with pytest.raises(CliError, match="--trace-url") as refused:
        LinkTemplate.parse(template, "--trace-url")
    assert said in str(refused.value)


@pytest.mark.parametrize("flag", ["--trace-url", "--temporal-url"])
def test_serve_refuses_a_bad_template_before_it_opens_the_store(
    flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = f"sqlite:{tmp_path / 'absent.db'}"
    assert main(["serve", store, "--port", "0", flag, "https://t/{workflow}"]) == 1
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"polyloop: error: {flag} 'https://t/{{workflow}}': unknown placeholder "
        "{workflow}; a template may hold {trace_id} and {run_id} only"
    ]
