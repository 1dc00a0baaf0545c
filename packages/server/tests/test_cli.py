"""The CLI is generated from ServerConfig: every field is an option with its default and choices."""

import dataclasses

import pytest

from lmserver.config import ServerConfig
from lmserver.edge.cli import build_parser, parse_config


def test_every_config_field_is_an_option() -> None:
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    options = {opt for action in serve._actions for opt in action.option_strings}
    for f in dataclasses.fields(ServerConfig):
        assert "--" + f.name.replace("_", "-") in options


def test_defaults_equal_the_config_defaults() -> None:
    assert parse_config([]) == ServerConfig()
    assert parse_config(["serve"]) == ServerConfig()


def test_values_types_and_flags_are_parsed() -> None:
    cfg = parse_config(["serve", "--port", "31000", "--max-total-tokens", "4096", "--mem-fraction-static", "0.5",
                        "--disable-radix-cache", "--schedule-policy", "fcfs", "--api-key", "k", "--log-requests"])
    assert cfg == ServerConfig(port=31000, max_total_tokens=4096, mem_fraction_static=0.5, disable_radix_cache=True,
                               schedule_policy="fcfs", api_key="k", log_requests=True)
    assert parse_config(["--port", "1"]).port == 1  # `serve` may be omitted


@pytest.mark.parametrize("argv", [["--schedule-policy", "random"], ["--port", "x"], ["--no-such-option"],
                                  ["--dtype", "int3"]])
def test_bad_options_exit_with_usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_config(argv)
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err
