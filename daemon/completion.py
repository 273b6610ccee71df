"""``tfelastic completion bash|zsh``: a completion script made from the parser itself, so it knows every
subcommand and flag of this version and never drifts from them."""

from __future__ import annotations

import argparse
import shlex

SHELLS = ("bash", "zsh")
_PATH_METAVARS = ("PATH", "PEM", "DIR", "JOB.toml")  # flags whose value is a file name


def subcommand_flags(parser: argparse.ArgumentParser) -> dict[str, tuple[list[str], list[str]]]:
    """For each subcommand: its flags, and those of them that take a file name."""
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    found: dict[str, tuple[list[str], list[str]]] = {}
    for name, sub in subparsers.choices.items():
        flags = [f for a in sub._actions for f in a.option_strings if f.startswith("--")]
        files = [f for a in sub._actions if a.metavar in _PATH_METAVARS for f in a.option_strings]
        found[name] = (sorted(flags), sorted(files))
    return found


def script(parser: argparse.ArgumentParser, shell: str) -> str:
    table = subcommand_flags(parser)
    cases = "\n".join(f"    {name}) flags={shlex.quote(' '.join(flags))}; files={shlex.quote(' '.join(files))} ;;"
                      for name, (flags, files) in table.items())
    bash = f"""# tfelastic completion for {shell} (tfelastic completion {shell})
_tfelastic() {{
  local cur=${{COMP_WORDS[COMP_CWORD]}} prev=${{COMP_WORDS[COMP_CWORD-1]}} command="" flags="" files="" word
  for word in "${{COMP_WORDS[@]:1:COMP_CWORD-1}}"; do
    case $word in -*) ;; *) command=$word; break ;; esac
  done
  if [[ -z $command ]]; then
    COMPREPLY=($(compgen -W "{' '.join(table)} --help --version" -- "$cur")); return
  fi
  case $command in
{cases}
  esac
  if [[ " $files " == *" $prev "* ]]; then COMPREPLY=($(compgen -f -- "$cur")); return; fi
  COMPREPLY=($(compgen -W "$flags" -- "$cur"))
}}
complete -o default -F _tfelastic tfelastic
"""
    if shell == "zsh":
        return "#compdef tfelastic\nautoload -U +X bashcompinit && bashcompinit\n" + bash
    return bash
