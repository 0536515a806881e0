"""``python -m trainer.tokenize TEXT... -o OUT.bin``: byte-level tokens for ``train.data``.

Each byte of the input files becomes one uint16 token (0–255), which is the vocabulary of
the ``tiny`` preset; the output is the flat token file :class:`trainer.data.TokenFile`
memory-maps. Files are streamed in chunks, so inputs larger than RAM are fine.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

_CHUNK = 16 << 20


def tokenize(sources: Sequence[Path], out: Path) -> int:
    """Write the byte tokens of ``sources`` (concatenated) to ``out``; returns the count."""
    count = 0
    with out.open("wb") as f:
        for source in sources:
            with source.open("rb") as src:
                while chunk := src.read(_CHUNK):
                    np.frombuffer(chunk, dtype=np.uint8).astype(np.uint16).tofile(f)
                    count += len(chunk)
    return count


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.tokenize", description=__doc__)
    parser.add_argument("sources", nargs="+", type=Path, help="text files")
    parser.add_argument("-o", "--output", type=Path, required=True, help="token file to write")
    args = parser.parse_args(argv)
    try:
        count = tokenize(args.sources, args.output)
    except OSError as exc:
        print(f"tokenize: {exc}", file=sys.stderr)
        return 2
    print(f"tokenize: {count} tokens -> {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
