"""The ``hybridflow`` command line.

User errors (a bad manifest, a missing file) print one message per problem to stderr and exit
with status 2, without a traceback; a traceback means a bug.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from hybridflow import __version__

EXIT_USER_ERROR = 2


def _validate(args: argparse.Namespace) -> int:
    from hybridflow.spec import SpecError, load_job_manifest

    try:
        job = load_job_manifest(args.manifest)
    except SpecError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USER_ERROR
    spec = job.spec
    pools = ", ".join(f"{p.name} ({p.nodes}x{p.gpus_per_node} GPU)" for p in spec.resource_pools)
    print(f"{args.manifest}: valid RLHFJob {job.metadata.name!r}")
    print(f"  algorithm {spec.algorithm.name}, {spec.training.total_steps} steps, rollout engine {spec.rollout.engine}")
    print(f"  pools: {pools}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridflow", description="HybridFlow RLHF on Ray.")
    parser.add_argument("--version", action="version", version=f"hybridflow {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    validate = commands.add_parser("validate", help="check an RLHFJob manifest and summarise it")
    validate.add_argument("manifest", help="path to an RLHFJob YAML manifest")
    validate.set_defaults(handler=_validate)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.handler(args))


if __name__ == "__main__":
    raise SystemExit(main())
