"""An entry module for fork-server tests: the child exits with the code written in its spec file."""

from pathlib import Path


def main(argv: list[str]) -> int:
    return int(Path(argv[0]).read_text())
