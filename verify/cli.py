"""The command-line pieces of `colibri verify-source SRC` and `colibri verify OUT`.

Each command prints its findings and a summary line (or, with `--json`, one JSON object)
and returns 0 when there is no error, 1 otherwise. An unusable argument (no such folder,
a repo id not in the cache) raises the library's one-line error for the caller to print.
"""

from __future__ import annotations

import argparse
import json


def _jobs(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"--jobs needs a positive whole number, not {text!r}")
    return value


def _common(p: argparse.ArgumentParser, jobs_default: str) -> None:
    p.add_argument("--jobs", type=_jobs, help=f"threads hashing in parallel (default: {jobs_default})")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object on stdout")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _print(report, as_json: bool) -> int:
    print(json.dumps(report.to_json(), indent=1) if as_json else report.text())
    return 0 if report.ok else 1


def add_verify_source_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", metavar="SRC", help="checkpoint folder, snapshot folder in the HF cache, or a hub repo id already in the cache")
    p.add_argument("--revision", help="hub revision when SRC is a repo id (default: main)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="structure only: index, headers, tensors against config.json; no hashing")
    mode.add_argument("--write-sums", action="store_true", help="write the shards' hashes to SRC/SHA256SUMS (when no error is found)")
    _common(p, "min(cores, shards)")


def verify_source_command(args: argparse.Namespace) -> int:
    from colibri.verify.sha_check import verify_source

    report = verify_source(args.src, args.revision, jobs=args.jobs, quick=args.quick, write_sums_file=args.write_sums,
                           progress=not (args.no_progress or args.json))
    return _print(report, args.json)


def add_verify_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("out", metavar="OUT", help="a converted model folder")
    p.add_argument("--quick", action="store_true", help="manifest (its own checksum included), file sizes, unlisted files; no hashing of the files")
    _common(p, "cores")


def verify_command(args: argparse.Namespace) -> int:
    from colibri.verify.model_check import verify_model

    report = verify_model(args.out, jobs=args.jobs, quick=args.quick, progress=not (args.no_progress or args.json))
    return _print(report, args.json)
