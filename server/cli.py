"""`dspark-serve`: parse flags (defaults from the component configs, then a config file, then the
command line), start the HTTP server at once, and load the engine in the background."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import logging
import os
import sys
import textwrap
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dspark_serve.drafter.config import NO_DRAFTER, DrafterConfig
from dspark_serve.drafter.registry import drafter_names, drafter_spec
from dspark_serve.scheduler.config import SchedulerConfig, policy_choices
from dspark_serve.server.config import ServerConfig
from dspark_serve.server.reasoning import REASONING_PARSER_NAMES
from dspark_serve.server.tool_formats import PARSER_NAMES
from dspark_serve.verifier.config import ModelConfig

if TYPE_CHECKING:
    from collections.abc import Mapping

    from prometheus_client import CollectorRegistry

    from dspark_serve.scheduler.async_engine import AsyncEngine

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
DEFAULT_CONFIG = "embedded"
# A config file's sections: one per component config; every key lives in its component's section.
SECTIONS = {
    "model": ModelConfig,
    "drafter": DrafterConfig,
    "scheduler": SchedulerConfig,
    "server": ServerConfig,
}
COMPONENTS = tuple(SECTIONS.values())


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a config dataclass, whitespace collapsed."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    node0 = tree.body[0]
    assert isinstance(node0, ast.ClassDef)
    body = node0.body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _choices_help(name: str) -> str:
    """What a field that names a registry entry can be, read from the registry."""
    if name == "drafter":
        return (
            "Choices: "
            + ", ".join([NO_DRAFTER] + [f"{n} ({drafter_spec(n).summary})" for n in drafter_names()])
            + "."
        )
    if name == "verify_policy":
        return "Choices: " + ", ".join(policy_choices()) + "."
    if name == "tool_call_parser":
        return "Choices: " + ", ".join(PARSER_NAMES) + "."
    if name == "reasoning_parser":
        return "Choices: " + ", ".join(REASONING_PARSER_NAMES) + "."
    return ""


def _flags() -> list[tuple[str, type, str, type]]:
    """(dest, component, help, argparse type) for every flag: one per config field, its help the
    field's docstring (plus the registry's choices for drafter and verify_policy)."""
    out = []
    for comp in COMPONENTS:
        docs = field_docs(comp)
        for f in dataclasses.fields(comp):
            t = {int: int, float: float, bool: bool}.get(type(f.default), str)
            help_ = " ".join(filter(None, [docs.get(f.name, ""), _choices_help(f.name)]))
            out.append((f.name, comp, help_.replace("%", "%%"), t))
    return out


def build_parser(suppress_defaults: bool = False) -> argparse.ArgumentParser:
    """suppress_defaults: parse only the flags actually given (to layer them over a file)."""
    p = argparse.ArgumentParser(
        prog="dspark-serve",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        argument_default=argparse.SUPPRESS if suppress_defaults else None,
        description="OpenAI-compatible server with load-aware speculative decoding (DSpark).",
    )
    p.add_argument(
        "--config",
        **({} if suppress_defaults else {"default": DEFAULT_CONFIG}),  # type: ignore[arg-type]
        help="a name under configs/ (without .toml) or a path to a TOML file; flags override it",
    )
    for name, comp, help_, typ in _flags():
        default = getattr(comp(), name)
        flag = "--" + name.replace("_", "-")
        kw = {} if suppress_defaults else {"default": default}
        if typ is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, help=help_, **kw)
        else:
            p.add_argument(flag, type=typ, help=help_, **kw)
    return p


def _config_path(spec: str) -> Path:
    path = Path(spec)
    if not path.suffix:
        path = CONFIG_DIR / f"{spec}.toml"
    if not path.is_file():
        raise ValueError(f"config {spec!r} not found (looked for {path.name} in configs/)")
    return path


def load_config_file(spec: str) -> dict[str, Any]:
    """The values a config file sets, by field name. Each section ([model], [drafter],
    [scheduler], [server]) is checked against its own component config: an unknown section, a
    key outside any section, or a key in the wrong section is a ValueError naming the file,
    the section and the key."""
    path = _config_path(spec)
    name = path.name if path.parent == CONFIG_DIR else str(path)
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"config {name}: {exc}") from exc
    owner = {f.name: sec for sec, comp in SECTIONS.items() for f in dataclasses.fields(comp)}
    flat: dict[str, Any] = {}
    for section, table in data.items():
        if not isinstance(table, dict):
            where = f"; it belongs in [{owner[section]}]" if section in owner else ""
            raise ValueError(f"config {name}: key {section!r} outside any section{where}")
        if section not in SECTIONS:
            raise ValueError(
                f"config {name}: unknown section [{section}]; the sections are "
                + ", ".join(f"[{s}]" for s in SECTIONS)
            )
        for key, value in table.items():
            if owner.get(key) != section:
                where = f"; it belongs in [{owner[key]}]" if key in owner else ""
                raise ValueError(f"config {name}: unknown key {key!r} in section [{section}]{where}")
            flat[key] = value
    return flat


def resolve(
    argv: list[str] | None = None,
) -> tuple[ModelConfig, DrafterConfig, SchedulerConfig, ServerConfig]:
    parser = build_parser()
    args = parser.parse_args(argv)
    given = vars(build_parser(suppress_defaults=True).parse_args(argv))
    values = vars(parser.parse_args([]))  # the component configs' defaults
    values.update(load_config_file(args.config))  # then the config file
    values.update(given)  # then the flags actually given
    out = []
    for comp in COMPONENTS:
        kwargs = {}
        for f in dataclasses.fields(comp):
            v = values[f.name]
            if f.default is None:  # optional fields: "", "none" or "None" from a flag mean None
                if v in ("", "none", "None"):
                    v = None
                elif v is not None and str(f.type).startswith("int"):
                    v = int(v)
            kwargs[f.name] = v
        out.append(comp(**kwargs))
    return tuple(out)


API_KEY_ENV = "DSPARK_API_KEY"


def resolve_api_key(cfg: ServerConfig, environ: Mapping[str, str]) -> ServerConfig:
    """Fill `api_key` at start-up from `api_key_file` or, when neither is given, from the
    DSPARK_API_KEY environment variable (so the key need not be on the command line)."""
    if cfg.api_key_file is not None:
        try:
            text = Path(cfg.api_key_file).read_text()
        except OSError as exc:
            raise ValueError(f"cannot read api_key_file {cfg.api_key_file!r}: {exc.strerror}") from exc
        if not text.strip():
            raise ValueError(f"api_key_file {cfg.api_key_file!r} is empty")
        # one key: itself; several: the file as written (its errors name lines of the file)
        key = text.strip() if len(text.strip().splitlines()) == 1 else text
        return dataclasses.replace(cfg, api_key=key, api_key_file=None)
    if cfg.api_key is None and environ.get(API_KEY_ENV):
        return dataclasses.replace(cfg, api_key=environ[API_KEY_ENV].strip())
    return cfg


def start_engine(
    model_cfg: ModelConfig, drafter_cfg: DrafterConfig, sched_cfg: SchedulerConfig, server_cfg: ServerConfig
) -> tuple[AsyncEngine, CollectorRegistry]:
    """Start loading the engine in its background thread; returns (AsyncEngine, the metrics'
    CollectorRegistry). Shared by `dspark-serve` and each Ray Serve replica."""
    from prometheus_client import CollectorRegistry

    # The engine side (torch) is imported only here, at run time: server/ modules never need it.
    from dspark_serve.scheduler.async_engine import AsyncEngine
    from dspark_serve.scheduler.builder import build_engine
    from dspark_serve.scheduler.metrics import EngineMetrics

    registry = CollectorRegistry()
    name = server_cfg.served_model_name or (
        Path(model_cfg.model).stem if model_cfg.model else "SmolLM2-135M-Instruct"
    )
    metrics = EngineMetrics(registry, name)
    engine = AsyncEngine(
        lambda on_stage=None: build_engine(model_cfg, drafter_cfg, sched_cfg, metrics, on_stage=on_stage),
        model_name=name,
        max_model_len=model_cfg.max_model_len,
    )
    engine.start()
    return engine, registry


def main(argv: list[str] | None = None) -> None:
    try:
        model_cfg, drafter_cfg, sched_cfg, server_cfg = resolve(argv)
        server_cfg = resolve_api_key(server_cfg, os.environ)
    except ValueError as exc:
        print(f"dspark-serve: error: {exc}", file=sys.stderr)
        sys.exit(2)
    logging.basicConfig(
        level=server_cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from dspark_serve.server.app import build_app
    from dspark_serve.server.serve import serve

    engine, registry = start_engine(model_cfg, drafter_cfg, sched_cfg, server_cfg)
    app = build_app(engine, server_cfg, registry)
    serve(app, engine, server_cfg)
    engine.stop()


if __name__ == "__main__":
    main()
