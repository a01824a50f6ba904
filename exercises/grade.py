"""``python -m exercises.grade NN [--reference]``: grade chapter NN's exercise (exit 1 unless full marks)."""

from __future__ import annotations

import argparse
import sys

from exercises.grading import grade, reference_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make grade CH=NN", description=__doc__)
    parser.add_argument("chapter", help="chapter number, e.g. 01")
    parser.add_argument("--reference", action="store_true", help="grade refimpl's own implementation instead")
    args = parser.parse_args(argv)
    if not args.chapter.isdigit():
        parser.error(f"chapter must be a number like 01, got {args.chapter!r}")
    path = reference_path(args.chapter) if args.reference else None
    report = grade(args.chapter, path)
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
