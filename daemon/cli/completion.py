"""``statetier completion bash|zsh|tcsh``: a shell completion script, written from the parser.

``run_completion(args)`` prints what shtab (``shtab.complete``) derives from ``build_parser()``:
the subcommands, each one's options and choices, file names where a path is asked for. Install
it with ``statetier completion bash > ~/.local/share/bash-completion/completions/statetier``
(or ``eval "$(statetier completion bash)"`` in ``~/.bashrc``); for zsh, write it as
``_statetier`` into a folder on ``$fpath``.
"""

from __future__ import annotations

import argparse

SHELLS = ("bash", "zsh", "tcsh")


def run_completion(args: argparse.Namespace) -> int:
    import shtab

    from . import build_parser

    print(shtab.complete(build_parser(), shell=args.shell))
    return 0
