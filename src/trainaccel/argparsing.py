"""Command-line errors in two lines: what is wrong (with the closest flag for a misspelt one), and where help is."""

from __future__ import annotations

import argparse
import re
import sys
from typing import NoReturn

from trainaccel.config import did_you_mean


class Parser(argparse.ArgumentParser):
    """argparse's parser, whose errors (and its subcommands') are two lines, not the whole usage."""

    def error(self, message: str) -> NoReturn:
        refuse(self, message)


def refuse(parser: argparse.ArgumentParser, message: str) -> NoReturn:
    """Print `prog: error: message` (naming the closest flag for an unknown one) and where help is; exit 2."""
    unknown = re.match(r"unrecognized arguments: (-\S+)", message)
    if unknown:
        flag = unknown.group(1).split("=")[0]
        message += did_you_mean(flag, set(re.findall(r"(?<![\w-])--?[A-Za-z][\w-]*", parser.format_help())))
    sys.stderr.write(f"{parser.prog}: error: {message}\n{parser.prog}: see `{parser.prog} --help`\n")
    sys.exit(2)


def two_line_errors(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """A parser built elsewhere (torchrun's) whose errors are `refuse`'s; returns it."""
    parser.error = lambda message: refuse(parser, message)  # type: ignore[method-assign]
    return parser
