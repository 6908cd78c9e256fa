"""What every example shares: where programs run (--model / --in-process / --connect) and JSON output."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from collections.abc import Iterator
from typing import Any

import k3rt


def parser(description: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=os.environ.get("K3RT_MODEL"),
                   help="checkpoint folder (default: $K3RT_MODEL); `k3rt make-tiny --arch k3 --out DIR` makes one")
    p.add_argument("--in-process", action="store_true",
                   help="run the engine on a thread of this process instead of a spawned engine process")
    p.add_argument("--connect", default=None, metavar="ADDR",
                   help="use a running k3rt DSL endpoint (tcp://host:port or ipc://path) instead of --model")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    return p


@contextlib.contextmanager
def backend(args: argparse.Namespace) -> Iterator[Any]:
    if args.connect:
        be = k3rt.connect(args.connect)
        try:
            yield be
        finally:
            be.shutdown()
    else:
        with k3rt.Runtime(model=args.model, in_process=args.in_process) as rt:
            yield rt


def emit(args: argparse.Namespace, result: Any, show: Any) -> None:
    """Print the result: as JSON with --json, otherwise through `show(result)`."""
    if args.json:
        print(json.dumps(result, ensure_ascii=False))
    else:
        show(result)
