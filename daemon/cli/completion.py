"""``statetier completion bash|zsh``: a shell completion script, written from the parser itself.

``script(parser, shell)`` walks ``build_parser()``'s subcommands and their options (no
dependency: neither shtab nor argcomplete is in the locked set) and prints one bash function
that completes the command's first word (the subcommands, ``--help``, ``--version``), then the
options of the subcommand given, and file names everywhere else (``complete -o default``).
zsh loads the same function through ``bashcompinit``. Install it with
``statetier completion bash > ~/.local/share/bash-completion/completions/statetier`` (or
``eval "$(statetier completion bash)"`` in ``~/.bashrc``).
"""

from __future__ import annotations

import argparse

SHELLS = ("bash", "zsh")


def run_completion(args: argparse.Namespace) -> int:
    from . import build_parser

    print(script(build_parser(), args.shell))
    return 0


def script(parser: argparse.ArgumentParser, shell: str) -> str:
    commands = _subcommands(parser)
    cases = "\n".join(f"        {name}) opts={_quoted(_options(sub))} ;;" for name, sub in commands.items())
    lines = [
        "# statetier shell completion (statetier completion " + shell + ")",
        *(["autoload -U +X bashcompinit && bashcompinit"] if shell == "zsh" else []),
        "_statetier() {",
        '    local cur="${COMP_WORDS[COMP_CWORD]}" opts',
        '    if [ "$COMP_CWORD" -eq 1 ]; then',
        f'        COMPREPLY=( $(compgen -W {_quoted([*commands, *_options(parser)])} -- "$cur") )',
        "        return",
        "    fi",
        '    case "${COMP_WORDS[1]}" in',
        cases,
        '        *) opts="" ;;',
        "    esac",
        '    if [[ "$cur" == -* ]]; then',
        '        COMPREPLY=( $(compgen -W "$opts" -- "$cur") )',
        "    fi",
        "}",
        "complete -o default -F _statetier statetier",
    ]
    return "\n".join(lines)


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _options(parser: argparse.ArgumentParser) -> list[str]:
    return [option for action in parser._actions for option in action.option_strings if option.startswith("--")]


def _quoted(words: list[str]) -> str:
    return '"' + " ".join(words) + '"'
