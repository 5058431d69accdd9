"""Command line of the Accelerate integration: ``python -m accelerate_plugins launch ...`` and the ``paro`` script.

``launch`` runs ``accelerate launch`` with a PaRO settings file, keeping the ordinary Accelerate config file::

    paro launch --paro-config paro.yaml -- --config_file acc.yaml train.py --lr 1e-4

The PaRO file is checked first (unknown keys, bad values), then ``PARO_CONFIG_FILE`` (and ``PARO_<FIELD>`` for each
``--set FIELD=VALUE``) is exported and ``accelerate launch`` runs with everything after ``--``; every worker's
`ParoPlugin.from_env` reads them. PaRO keys cannot go into the Accelerate YAML: ``accelerate launch`` rejects unknown
keys.

The ``paro`` console script dispatches: ``paro launch ...`` runs `launch` here, every other command (``paro advise
...``) goes to the engine's own CLI, ``paro_zero_backend.__main__`` (the engine never imports this integration).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Sequence

from .paro_plugin import CONFIG_FILE_ENV, ENV_PREFIX, ParoPlugin

__all__ = ["build_parser", "launch", "main", "paro_main"]


def _add_launch_arguments(lp: argparse.ArgumentParser) -> None:
    lp.add_argument("--paro-config", required=True, help="PaRO settings (YAML or JSON; keys of ParoPlugin)")
    lp.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                    help="override one field (exported as PARO_<FIELD>), e.g. --set strategy=NIG; repeatable")
    lp.add_argument("--dry-run", action="store_true", help="print the command and environment, do not run it")
    lp.add_argument("accelerate_args", nargs=argparse.REMAINDER,
                    help="`--` then the arguments of `accelerate launch` (e.g. --config_file acc.yaml train.py ...)")


def build_parser(prog: str = "python -m accelerate_plugins") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="PaRO-DP under Accelerate and transformers.Trainer.")
    sub = parser.add_subparsers(dest="command", required=True)
    lp = sub.add_parser("launch", help="run `accelerate launch` with a PaRO settings file (ParoAccelerator/Trainer)",
                        description="Check a PaRO YAML/JSON file, export PARO_CONFIG_FILE (read by "
                                    "accelerate_plugins.ParoPlugin in every worker) and run `accelerate launch` with "
                                    "the arguments after `--` (config file, script, script arguments).",
                        epilog="example: paro launch --paro-config paro.yaml -- --config_file acc.yaml train.py")
    _add_launch_arguments(lp)
    return parser


def launch(args: argparse.Namespace) -> int:
    """Validate the PaRO file and overrides exactly as the workers will read them, then run accelerate launch."""
    rest = list(args.accelerate_args)
    if rest and rest[0] == "--":
        rest = rest[1:]
    if not rest:
        raise SystemExit("error: nothing to launch: put the `accelerate launch` arguments after `--`, e.g. "
                         "`paro launch --paro-config paro.yaml -- --config_file acc.yaml train.py`.")
    env = dict(os.environ)
    env[CONFIG_FILE_ENV] = os.path.abspath(args.paro_config)
    for item in args.set:
        field, sep, value = item.partition("=")
        if not sep or field.strip().lower() not in ParoPlugin.field_names():
            raise SystemExit(f"error: --set {item!r}: expected FIELD=VALUE with FIELD one of "
                             f"{ParoPlugin.field_names()}.")
        env[f"{ENV_PREFIX}{field.strip().upper()}"] = value
    try:
        plugin = ParoPlugin.from_env(env)  # the same path every worker takes: file, then variables
    except (ValueError, FileNotFoundError) as exc:
        raise SystemExit(f"error: {exc}") from None
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *rest]
    paro_env = {k: v for k, v in env.items() if k.startswith(ENV_PREFIX)}
    print(f"paro launch: {plugin.strategy} ({json.dumps(paro_env)}); running: accelerate launch {' '.join(rest)}",
          flush=True)
    if args.dry_run:
        return 0
    return subprocess.run(cmd, env=env).returncode


def main(argv: Sequence[str] | None = None, prog: str = "python -m accelerate_plugins") -> int:
    args = build_parser(prog).parse_args(argv)
    return launch(args)


def paro_main(argv: Sequence[str] | None = None) -> int:
    """The ``paro`` console script: ``launch`` here, everything else (``advise``) in ``paro_zero_backend``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["launch"]:
        return main(argv, prog="paro")
    if argv[:1] in ([], ["-h"], ["--help"]):
        print("usage: paro {advise,launch} ...\n\n"
              "  advise  rank the 14 PaRO strategies by predicted step time and memory (paro advise --help)\n"
              "  launch  run `accelerate launch` with a PaRO settings file (paro launch --help)")
        return 0 if argv else 2
    from paro_zero_backend.__main__ import main as engine_main

    return engine_main(argv)
