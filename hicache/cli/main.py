"""`hicache` command line: argument parsing and dispatch only; each command's work lives in
the package it belongs to. Errors from hicache print as one clear message and exit 2."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from hicache.errors import HicacheError

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = REPO_ROOT / "configs" / "default.yaml"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hicache", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    layout = sub.add_parser("layout", help="print a model's cache layout")
    layout.add_argument("path", type=Path, help="config.json, or a YAML layer list or deployment")
    layout.add_argument("--json", action="store_true", help="one JSON object (a stable contract)")
    layout.add_argument("--start-layer", type=int, default=None)
    layout.add_argument("--end-layer", type=int, default=None)

    config = sub.add_parser("config", help="validate, show or describe deployment files")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    validate = config_sub.add_parser("validate", help="check a deployment file")
    validate.add_argument("file", type=Path)
    show = config_sub.add_parser("show", help="the effective config with each value's source")
    show.add_argument("file", type=Path)
    show.add_argument("--json", action="store_true")
    config_sub.add_parser("schema", help="the deployment JSON Schema")
    config_sub.add_parser("reference", help="the configuration reference (Markdown)")

    serve = sub.add_parser("serve", help="run the sidecar until SIGTERM/SIGINT")
    serve.add_argument("--config", type=Path, default=DEFAULT_CONFIG)

    demo = sub.add_parser(
        "demo", help="the main job: a sidecar and a synthetic engine replaying a chat trace"
    )
    demo.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    demo.add_argument("--model", type=Path, help="a config.json to use instead of the config's")
    demo.add_argument("--json", action="store_true", help="end with one JSON line of figures")
    demo.add_argument(
        "--host-capacity",
        default=None,
        help="the sidecar's L2 (default: sized from the layout, KV pages that spill to L3 "
        "plus a few state snapshots)",
    )
    demo.add_argument("--device-pages", type=int, default=64, help="the engine's pool per group")
    demo.add_argument("--prefill-tokens-per-s", type=float, default=50_000.0)
    demo.add_argument("--keep", action="store_true", help="keep the run directory")
    trace = demo.add_argument_group("trace")
    for name, value in _trace_defaults():
        trace.add_argument(f"--{name.replace('_', '-')}", type=int, default=value)
    return parser


def _trace_defaults() -> list[tuple[str, int]]:
    from dataclasses import asdict

    from hicache.demo.trace import TraceOptions

    return list(asdict(TraceOptions()).items())


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "layout":
            return cmd_layout(args)
        if args.command == "config":
            return cmd_config(args)
        if args.command == "serve":
            return cmd_serve(args)
        return cmd_demo(args)
    except HicacheError as exc:
        print(f"hicache: error: {exc}", file=sys.stderr)
        return 2


def _layer_map_for(path: Path, start: int | None, end: int | None):  # type: ignore[no-untyped-def]
    """The layer map of a config.json, a YAML layer list or a deployment, and the model name
    its page keys are seeded with."""
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
            layout = loaded.layout()
            model = loaded.deployment.model
            layer_map = LayerMap(
                layout,
                model.start_layer if start is None else start,
                model.end_layer if end is None else end,
            )
            return layer_map, loaded.model_name(), loaded.deployment
    layout = load_layout(path)
    return LayerMap(layout, start or 0, end), model_identity(path, layout), None


def cmd_layout(args: argparse.Namespace) -> int:
    from hicache.config.sizes import format_bytes
    from hicache.memory import CacheDtypes, GroupGeometry
    from hicache.memory.sizing import sizing, sizing_lines
    from hicache.model.render import layout_json, layout_table

    layer_map, name, deployment = _layer_map_for(args.path, args.start_layer, args.end_layer)
    if deployment is not None:
        dtypes, page = CacheDtypes.of_model(deployment.model), deployment.model.page_size_tokens
        capacity, fraction = deployment.host.capacity_bytes, deployment.host.state_fraction
    else:  # a bare config: the defaults a deployment would start from
        dtypes, page, capacity, fraction = CacheDtypes.from_names("bfloat16"), 16, None, 0.25
    geometries = [GroupGeometry.of(g, dtypes, page) for g in layer_map.groups]
    rows = sizing(geometries, capacity, fraction)
    if args.json:
        print(json.dumps({**layout_json(layer_map, name), "sizing": rows}))
        return 0
    print(layout_table(layer_map, name))
    label = format_bytes(capacity) if capacity else None
    extra = "" if deployment is not None else " (bfloat16, 16-token pages)"
    lines = sizing_lines(rows, label)
    lines[0] += extra
    print("\n".join(lines))
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
        from hicache.service.app import host_pages

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
    from hicache.scheduler import run
    from hicache.service.app import serve

    return run(serve(load_deployment(args.config)))


def cmd_demo(args: argparse.Namespace) -> int:
    from hicache.config import load_deployment
    from hicache.demo import run_demo
    from hicache.demo.trace import TraceOptions
    from hicache.model.render import layout_table

    env = dict(os.environ)
    if args.model is not None:
        env["HICACHE_MODEL__CONFIG_PATH"] = str(args.model.resolve())
    loaded = load_deployment(args.config, env=env)
    if not args.json:
        print(f"== deployment {args.config}")
        print(format_effective(loaded.effective()))
        print()
        print("== layout")
        print(layout_table(loaded.layer_map()))
    trace = TraceOptions(**{name: getattr(args, name) for name, _ in _trace_defaults()})
    host_bytes, state_fraction = args.host_capacity, None
    if host_bytes is None:  # sized from the layout: a large hybrid's snapshot is tens of MiB
        from hicache.demo import host_plan
        from hicache.memory import CacheDtypes, GroupGeometry

        d = loaded.deployment
        dtypes = CacheDtypes.of_model(d.model)
        plan = host_plan(
            [
                GroupGeometry.of(g, dtypes, d.model.page_size_tokens)
                for g in loaded.layer_map().groups
            ]
        )
        host_bytes, state_fraction = str(plan.capacity_bytes), plan.state_fraction
        if not args.json:
            print(plan.line())
    return run_demo(
        args.config,
        storage_kind=loaded.deployment.storage.kind,
        model=args.model,
        trace=trace,
        host_bytes=host_bytes,
        state_fraction=state_fraction,
        device_pages=args.device_pages,
        prefill_tokens_per_s=args.prefill_tokens_per_s,
        as_json=args.json,
        keep=args.keep,
    )
