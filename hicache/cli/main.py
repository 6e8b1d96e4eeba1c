"""`hicache` command line: argument parsing and dispatch only; each command's work lives in
the package it belongs to. Errors from hicache print as one clear message and exit 2; a
closed stdout (`hicache ... | head -1`) ends the command quietly."""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from hicache import __version__
from hicache.defaults import default_config_path
from hicache.errors import HicacheError

if TYPE_CHECKING:
    from hicache.model import ModelLayout

# the deployment shipped inside the package (the same as the repository's configs/default.yaml,
# state under ~/.cache/hicache): a wheel or an image runs a bare `hicache serve`
DEFAULT_CONFIG = default_config_path()
EXIT_EPIPE = 141  # 128 + SIGPIPE, what a shell shows for a writer whose reader went away
_DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2")
_TRACE_HELP = {
    "conversations": "chat conversations in the trace",
    "turns": "turns per conversation (each extends the previous prompt)",
    "system_prompts": "distinct system prompts the conversations share",
    "system_tokens": "tokens per system prompt",
    "turn_tokens": "tokens each turn adds (reply plus the next user message)",
    "cold_requests": "requests with nothing cached, among the conversations",
    "cold_tokens": "tokens per cold request",
    "seed": "random seed of the trace",
    "vocab": "token ids are drawn from range(vocab)",
}
_CONFIG_HELP = f"deployment YAML (default: the packaged default, {DEFAULT_CONFIG})"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hicache", description=__doc__)
    parser.add_argument(
        "--version", action="version", version=f"hicache {__version__}", help="print the version"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    layout = sub.add_parser(
        "layout",
        help="print a model's cache layout, page bytes and what a GiB of L2 holds",
        description="A model's cache layout: layers, cache groups, bytes per page and tokens "
        "(state groups: snapshots) per GiB of L2. Stages: --start-layer inclusive, "
        "--end-layer exclusive.",
    )
    layout.add_argument("path", type=Path, help="config.json, or a YAML layer list or deployment")
    layout.add_argument("--json", action="store_true", help="one JSON object (a stable contract)")
    layout.add_argument(
        "--start-layer",
        type=int,
        default=None,
        help="first layer of the pipeline stage, inclusive (default: a deployment's "
        "model.start_layer, else 0)",
    )
    layout.add_argument(
        "--end-layer",
        type=int,
        default=None,
        help="layer the stage ends before, exclusive (default: a deployment's model.end_layer, "
        "else the model's layer count)",
    )
    layout.add_argument(
        "--page-size",
        type=int,
        default=None,
        metavar="TOKENS",
        help="tokens per page for the page bytes (default: a deployment's "
        "model.page_size_tokens, else 16)",
    )
    layout.add_argument(
        "--tp-size",
        type=int,
        default=None,
        metavar="N",
        help="tensor-parallel size: show one rank's share, heads and bytes per page per rank "
        "(default: a deployment's model.tp_size, else 1)",
    )
    layout.add_argument(
        "--dtype",
        choices=_DTYPES,
        default=None,
        help="cache dtype for the page bytes (default: a deployment's model dtypes, else the "
        "config.json's torch_dtype, else bfloat16)",
    )

    config = sub.add_parser(
        "config",
        help="validate, show or describe deployment files",
        description="Validate, show or describe deployment files.",
    )
    config_sub = config.add_subparsers(dest="config_command", metavar="SUBCOMMAND")
    validate = config_sub.add_parser(
        "validate", help="check a deployment file (as `hicache serve` would before starting)"
    )
    validate.add_argument("file", type=Path, help="deployment YAML")
    show = config_sub.add_parser("show", help="the effective config with each value's source")
    show.add_argument("file", type=Path, help="deployment YAML")
    show.add_argument(
        "--json", action="store_true", help="a JSON list of {key, value, source} objects"
    )
    config_sub.add_parser("schema", help="the deployment JSON Schema")
    config_sub.add_parser("reference", help="the configuration reference (Markdown)")
    parser.set_defaults(subparsers={"config": config})

    serve = sub.add_parser("serve", help="run the sidecar until SIGTERM/SIGINT")
    serve.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help=_CONFIG_HELP)

    from hicache.cli.stats import add_stats_parser

    add_stats_parser(sub, DEFAULT_CONFIG)

    demo = sub.add_parser(
        "demo",
        help="the main job: a sidecar and a synthetic engine replaying a chat trace",
        description="A sidecar and a synthetic engine replaying a chat trace. Real engines "
        "attach to `hicache serve` the same way: vLLM through its KV connector "
        "(hicache.integrations.vllm) and SGLang through its HiCache storage backend "
        "(hicache.integrations.sglang); see docs/engines.md.",
    )
    demo.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help=_CONFIG_HELP)
    demo.add_argument("--model", type=Path, help="a config.json to use instead of the config's")
    demo.add_argument("--json", action="store_true", help="end with one JSON line of figures")
    demo.add_argument(
        "--host-capacity",
        default=None,
        help="the sidecar's L2 (default: sized from the layout, KV pages that spill to L3 "
        "plus a few state snapshots)",
    )
    demo.add_argument("--device-pages", type=int, default=64, help="the engine's pool per group")
    demo.add_argument(
        "--prefill-tokens-per-s",
        type=float,
        default=50_000.0,
        help="the simulated engine's prefill speed for tokens not cached (default: 50000)",
    )
    demo.add_argument("--keep", action="store_true", help="keep the run directory")
    demo.add_argument(
        "--timeline",
        type=Path,
        default=None,
        metavar="PATH",
        help="also write the per-layer load timeline to PATH, as .html and .png (kept; needs "
        "matplotlib: pip install 'hicache[plots]')",
    )
    trace = demo.add_argument_group("trace")
    for name, value in _trace_defaults():
        trace.add_argument(
            f"--{name.replace('_', '-')}",
            type=int,
            default=value,
            help=f"{_TRACE_HELP.get(name, name.replace('_', ' '))} (default: {value})",
        )
    return parser


def _trace_defaults() -> list[tuple[str, int]]:
    from dataclasses import asdict

    from hicache.demo.trace import TraceOptions

    return list(asdict(TraceOptions()).items())


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)  # --help and --version print here
        code = _dispatch(parser, args)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at interpreter exit
        return code
    except BrokenPipeError:
        return _stdout_gone()
    except OSError as exc:
        if exc.errno == errno.EPIPE:
            return _stdout_gone()
        raise
    except HicacheError as exc:
        print(f"hicache: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _stdout_gone() -> int:
    """The reader of stdout went away (`| head`): point stdout at /dev/null so the flush at
    exit cannot raise again, and end quietly."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
    return EXIT_EPIPE


def _dispatch(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.command is None:
        parser.print_help(sys.stderr)
        print(
            "hicache: error: name a command (layout, config, serve, stats, demo)", file=sys.stderr
        )
        return 2
    if args.command == "layout":
        return cmd_layout(args)
    if args.command == "config":
        if args.config_command is None:
            args.subparsers["config"].print_help(sys.stderr)
            print(
                "hicache config: error: name a subcommand (validate, show, schema, reference)",
                file=sys.stderr,
            )
            return 2
        return cmd_config(args)
    if args.command == "serve":
        return cmd_serve(args)
    if args.command == "stats":
        from hicache.cli.stats import cmd_stats

        return cmd_stats(args)
    return cmd_demo(args)


def _layer_map_for(  # type: ignore[no-untyped-def]
    path: Path, start: int | None, end: int | None, tp_size: int | None = None
):
    """The layer map of a config.json, a YAML layer list or a deployment (one rank's share
    at `tp_size`, default: the deployment's model.tp_size, else 1), and the model name its
    page keys are seeded with."""
    from hicache.config import load_deployment
    from hicache.model import LayerMap, load_layout, model_identity

    if path.suffix in {".yaml", ".yml"}:
        import yaml

        try:
            is_deployment = isinstance(data := yaml.safe_load(path.read_text()), dict) and (
                "model" in data
            )
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            is_deployment = False  # load_layout (or load_deployment) names what is wrong
        if is_deployment:
            loaded = load_deployment(path)
            model = loaded.deployment.model
            if tp_size is None:
                layout = loaded.layout()
            else:
                layout = _sharded(loaded.global_layout(), tp_size)
            layer_map = LayerMap(
                layout,
                model.start_layer if start is None else start,
                model.end_layer if end is None else end,
            )
            return layer_map, loaded.model_name(), loaded.deployment
    layout = load_layout(path)
    name = model_identity(path, layout)
    layout = _sharded(layout, 1 if tp_size is None else tp_size)
    return LayerMap(layout, start or 0, end), name, None


def _sharded(layout: ModelLayout, tp_size: int) -> ModelLayout:
    """`shard_layout(layout, tp_size)`, its refusal as the flag's error."""
    from hicache.model import shard_layout

    try:
        return shard_layout(layout, tp_size)
    except HicacheError as exc:
        raise HicacheError(f"--tp-size {tp_size}: {exc}") from None


def _config_torch_dtype(path: Path) -> str | None:
    """A config.json's `torch_dtype` (or `dtype`, or its text config's), when it names a cache
    dtype hicache knows."""
    if path.suffix != ".json":
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    for node in (data, data.get("text_config") if isinstance(data, dict) else None):
        if isinstance(node, dict):
            for key in ("torch_dtype", "dtype"):
                if node.get(key) in _DTYPES:
                    return str(node[key])
    return None


def cmd_layout(args: argparse.Namespace) -> int:
    from hicache.assembly import model_dtypes
    from hicache.config.sizes import format_bytes
    from hicache.memory import CacheDtypes, group_geometries
    from hicache.memory.sizing import sizing
    from hicache.model.render import layout_json, layout_table

    if args.page_size is not None and args.page_size < 1:
        raise HicacheError(f"--page-size {args.page_size}: allowed: a positive token count")
    layer_map, name, deployment = _layer_map_for(
        args.path, args.start_layer, args.end_layer, args.tp_size
    )
    if deployment is not None:
        model = deployment.model
        dtypes = (
            model_dtypes(model)
            if args.dtype is None
            else CacheDtypes.from_names(args.dtype, model.state_dtype, model.ssm_state_dtype)
        )
        page = model.page_size_tokens if args.page_size is None else args.page_size
        capacity, fraction = deployment.host.capacity_bytes, deployment.host.state_fraction
        dtype_label = str(dtypes.kv).removeprefix("torch.")
    else:  # a bare config: the defaults a deployment would start from
        dtype = args.dtype or _config_torch_dtype(args.path) or "bfloat16"
        dtypes, capacity, fraction = CacheDtypes.from_names(dtype), None, 0.25
        page, dtype_label = args.page_size or 16, dtype
    geometries = list(group_geometries(layer_map.groups, dtypes, page).values())
    rows = sizing(geometries, capacity, fraction)
    if args.json:
        print(json.dumps({**layout_json(layer_map, name, rows, page), "sizing": rows}))
        return 0
    note = f"({dtype_label}, {page}-token pages"
    note += f"; host.capacity_bytes {format_bytes(capacity)})" if capacity else ")"
    holds = {g: f"{r['l2_' + r['unit']]:,} {r['unit']}" for g, r in rows.items() if "l2_pages" in r}
    print(layout_table(layer_map, name, rows, page, note, holds))
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from hicache.config import Deployment, load_deployment

    if args.config_command == "schema":
        print(json.dumps(Deployment.model_json_schema(), indent=2))
        return 0
    if args.config_command == "reference":
        from hicache.config.reference import config_reference

        print(config_reference(), end="")
        return 0
    loaded = load_deployment(args.file)
    layer_map = loaded.layer_map()
    if args.config_command == "validate":
        from hicache.assembly import host_pages

        host_pages(loaded, layer_map)  # what `hicache serve` refuses before it starts
        print(
            f"{args.file}: ok ({layer_map.model_type}, {layer_map.layout.num_layers} layers, "
            f"{len(layer_map.groups)} cache groups)"
        )
        return 0
    rows = loaded.effective()
    if args.json:
        print(json.dumps([{"key": k, "value": v, "source": s} for k, v, s in rows]))
        return 0
    print(format_effective(rows))
    return 0


def format_effective(rows: Sequence[tuple[str, object, str]]) -> str:
    width = max(len(k) for k, _, _ in rows)
    lines = []
    for key, value, source in rows:
        shown = json.dumps(value) if not isinstance(value, str) else value
        lines.append(f"{key:<{width}}  {shown:<40}  # {source}")
    return "\n".join(lines)


def cmd_serve(args: argparse.Namespace) -> int:
    from hicache.config import load_deployment

    loaded = load_deployment(args.config)  # a bad file is refused before torch is imported
    from hicache.scheduler import run
    from hicache.service.app import serve

    return run(serve(loaded))


def cmd_demo(args: argparse.Namespace) -> int:
    from hicache.config import load_deployment
    from hicache.demo.run import run_demo
    from hicache.demo.trace import TraceOptions
    from hicache.model.render import layout_table

    env = dict(os.environ)
    if args.model is not None:
        env["HICACHE_MODEL__CONFIG_PATH"] = str(args.model.resolve())
    loaded = load_deployment(args.config, env=env)
    if not args.json:  # the deployment itself: the demo prints what its sidecar runs
        print("== layout")
        print(layout_table(loaded.layer_map()))
    trace = TraceOptions(**{name: getattr(args, name) for name, _ in _trace_defaults()})
    return run_demo(
        args.config,
        storage_kind=loaded.deployment.storage.kind,
        model=args.model,
        trace=trace,
        host_bytes=args.host_capacity,  # None: sized from the layout by the demo
        device_pages=args.device_pages,
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        as_json=args.json,
        keep=args.keep,
        timeline=args.timeline,
    )
