"""The `lmserver` command (also `python -m lmserver`). Options are generated from the fields of
`ServerConfig` (type, default, `help` and `choices` metadata), so a new config field is a new
option with no change here.

    lmserver serve --model-path PATH --port 30000 ...   (`serve` may be omitted)
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import types
import typing
from collections.abc import Mapping
from typing import Any

from lmserver.config import API_KEY_ENV, ServerConfig


def _base_type(hint: Any) -> type:
    """`int | None` -> int; `str` -> str."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) != 1:
            raise TypeError(f"unsupported config field type {hint!r}")
        return args[0]  # type: ignore[no-any-return]
    return hint  # type: ignore[no-any-return]


def add_config_args(parser: argparse.ArgumentParser) -> None:
    """Adds one `--field-name` option per ServerConfig field (booleans become flags)."""
    hints = typing.get_type_hints(ServerConfig)
    for f in dataclasses.fields(ServerConfig):
        flag = "--" + f.name.replace("_", "-")
        kind = _base_type(hints[f.name])
        help_text = f.metadata.get("help", "")
        if kind is bool:
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default,
                                help=help_text)
            continue
        default_text = "" if f.default is None else f" (default: {f.default})"
        parser.add_argument(flag, dest=f.name, type=kind, default=f.default,
                            choices=f.metadata.get("choices"), help=help_text + default_text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lmserver", description="OpenAI-compatible and SGLang-native LM server.")
    sub = parser.add_subparsers(dest="command")
    serve = sub.add_parser("serve", help="start the HTTP server (the default command)")
    sub.add_parser("route", help="run the cache-aware router alone: lmserver route --worker URL ...", add_help=False)
    add_config_args(serve)
    return parser


def parse_config(argv: list[str], environ: Mapping[str, str] | None = None) -> ServerConfig:
    """The ServerConfig given by command-line options (`serve` optional), the API key from
    `environ[API_KEY_ENV]` when no `--api-key` is given. Exits on bad options."""
    argv = list(argv)
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["serve", *argv]
    ns = build_parser().parse_args(argv)
    if ns.command != "serve":
        build_parser().print_help()
        raise SystemExit(2)
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(ServerConfig)}
    if values.get("api_key") is None and environ is not None and environ.get(API_KEY_ENV):
        values["api_key"] = environ[API_KEY_ENV]
    return ServerConfig(**values)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "route":
        from lmserver.edge.router.app import main as route_main

        return route_main(argv[1:])
    config = parse_config(argv, os.environ)
    if config.nnodes > 1 and config.node_rank > 0:
        from lmserver.runner.tp_engine import run_follower_node

        return run_follower_node(config)
    if config.dp_size > 1:
        from lmserver.edge.dp_launch import launch_dp

        return launch_dp(config)
    from lmserver.edge.launch import launch_server

    return launch_server(config)
