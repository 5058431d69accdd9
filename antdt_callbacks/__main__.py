"""Command line: ``python -m antdt_callbacks serve ...`` runs the sharding service; ``status`` queries one; ``evict``
asks one to evict a node (refused with the reason when the job's rules forbid it)."""

from __future__ import annotations

import argparse
import gc
import json
import sys

from .config import AgentConfig, ControllerConfig, JobConfig, MonitorConfig, ServeConfig


def _add_dataclass_args(p: argparse.ArgumentParser, cls, skip: tuple[str, ...] = ()) -> None:
    import dataclasses

    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        help_ = f.metadata.get("help", "")
        if f.type in ("bool", bool):
            p.add_argument(flag, type=lambda s: s.lower() in ("1", "true", "yes"), default=f.default,
                           help=f"{help_} (true/false, default {f.default})")
        else:
            typ = {"int": int, "float": float}.get(str(f.type), str)
            if str(f.type).startswith("str | None") or str(f.type).startswith("int | None"):
                typ = int if str(f.type).startswith("int") else str
            p.add_argument(flag, type=typ, default=f.default, help=f"{help_} (default {f.default})")


def _pick(ns: argparse.Namespace, cls) -> dict:
    import dataclasses

    return {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m antdt_callbacks",
                                     description="AntDT stateful dynamic data-sharding service.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    serve = sub.add_parser("serve", help="run the sharding service (HTTP/JSON, SQLite state)")
    _add_dataclass_args(serve, ServeConfig)
    _add_dataclass_args(serve, JobConfig)
    _add_dataclass_args(serve, MonitorConfig)
    _add_dataclass_args(serve, ControllerConfig)
    serve.add_argument("--log-level", default="warning", help="transformers-style log level (default warning)")
    status = sub.add_parser("status", help="print a running service's status as JSON")
    status.add_argument("--url", required=True, help="http://host:port of the service")
    status.add_argument("--token", default=None, help="shared token (default $ANTDT_TOKEN)")
    evict = sub.add_parser("evict", help="evict a node: its ranks checkpoint with the others and leave, the job "
                                         "re-forms without it, and it is blacklisted")
    evict.add_argument("--url", required=True, help="http://host:port of the service")
    evict.add_argument("--token", default=None, help="shared token (default $ANTDT_TOKEN)")
    evict.add_argument("--node", required=True, help="the node's name (ANTDT_NODE_ID of its workers)")
    evict.add_argument("--reason", default="evicted by an operator", help="why (kept with the blacklist entry)")
    args = parser.parse_args(argv)
    if args.cmd in ("status", "evict"):
        from .client import ShardingClient
        from .errors import ServiceError

        client = ShardingClient(args.url, config=AgentConfig(url=args.url, token=args.token, retry_timeout_s=5))
        try:
            reply = client.status() if args.cmd == "status" else client.evict(args.node, args.reason)
        except ServiceError as e:
            print(f"error: {e.code}: {e.message}", file=sys.stderr)
            return 1
        print(json.dumps(reply, indent=2))
        return 0
    import logging

    from .server import ShardingService

    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.WARNING),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        svc = ShardingService(ServeConfig(**_pick(args, ServeConfig)), JobConfig(**_pick(args, JobConfig)),
                              MonitorConfig(**_pick(args, MonitorConfig)),
                              ControllerConfig(**_pick(args, ControllerConfig)))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"antdt service listening on {svc.url} (db {args.db})", flush=True)
    # What exists now (imported modules, the loaded state) lives as long as the process: keep it out of the cyclic
    # collector's full collections, which would walk it all again each time and stop the service meanwhile.
    gc.collect()
    gc.freeze()
    try:
        svc.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
