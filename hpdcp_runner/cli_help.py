"""What the CLI answers before Hydra runs: ``--help`` (jobs and the choices of each config group,
written for users, without the internal ``*_schema`` entries), shell completion that works for
``python -m hpdcp_runner`` as well as ``hpdcp``, and print-only flags answered once under torchrun
(rank 0), not once per rank."""

from __future__ import annotations

import os
import re
import shutil
import sys
import textwrap

from .config import JOB_HELP
from .paths import find_conf_dir

# Hydra flags that print something and run no job: under torchrun only rank 0 runs them.
PRINT_ONLY_FLAGS = ("--help", "-h", "--hydra-help", "--cfg", "-c", "--info", "-i", "--resolve", "-p", "--package",
                    "--shell-completion", "-sc")
GROUPS_SHOWN = ("layout", "model", "planner", "storage", "transform", "experiment")


def _first_comment(path: str) -> str:
    """A config file's description: the first sentence of its first comment paragraph (usage
    lines and the ``hydra/launcher=name:`` label left out), whole, however many lines it spans."""
    words: list[str] = []
    with open(path) as f:
        for line in f:
            text = line.strip()
            if not text.startswith("#") or text.startswith(("# @package", "# python ", "# torchrun ", "#   ")):
                if words:
                    break
                continue
            words += text.lstrip("#").split()
    text = " ".join(words)
    text = re.sub(r"^[\w/+]+=[\w]+: ", "", text)  # "hydra/launcher=local_2ranks: the SLURM path..."
    end = re.search(r"(?<!\.)\.(\s|$)", text)  # a sentence's end, not "e.g." inside it nor "..."
    text = text[:end.start() + 1] if end else text
    return text[:1].upper() + text[1:]


def _entry(name: str, text: str, width: int, pad: int = 22) -> list[str]:
    """``  name   description`` with the description wrapped at word boundaries under itself."""
    body = textwrap.wrap(text, max(30, width - pad - 3), break_on_hyphens=False) or [""]
    return [f"  {name:<{pad}} {body[0]}"] + [f"  {'':<{pad}} {line}" for line in body[1:]]


def group_choices(conf_dir: str, group: str) -> list[tuple[str, str]]:
    """(choice, description) of one config group, from its YAML files."""
    d = os.path.join(conf_dir, group)
    names = sorted(n[:-5] for n in os.listdir(d) if n.endswith(".yaml")) if os.path.isdir(d) else []
    return [(n, _first_comment(os.path.join(d, n + ".yaml"))) for n in names]


# hydra/launcher choices that live in code (ConfigStore), not in conf/hydra/launcher/*.yaml
LAUNCHERS_IN_CODE = (("hpdcp_torchrun", "Each sweep point as its own distributed job of "
                                        "hydra.launcher.nproc_per_node torch workers on this machine."),
                     ("hpdcp_submitit_local", "Each point one job of nodes x tasks_per_node ranks through submitit's "
                                              "local executor (the slurm extra)."),
                     ("hpdcp_submitit_slurm", "Each point one SLURM job of nodes x tasks_per_node ranks (the slurm "
                                              "extra: pip install -e \".[slurm]\")."))


def render_help(prog: str) -> str:
    conf = find_conf_dir()
    width = shutil.get_terminal_size((100, 24)).columns
    lines = [f"usage: {prog} +job=<name> [group=choice ...] [key=value ...]",
             f"       {'hpdcp' if prog == 'hpdcp' else prog} --nproc-per-node=N +job=<name> [...]   (N ranks: "
             f"torchrun's launcher in-process, one-line failures)",
             "       torchrun --nproc-per-node=N -m hpdcp_runner +job=<name> [...]",
             "  Launcher options (--nproc-per-node, --nnodes, --rdzv-endpoint, ...) come first; the rest is the job's.",
             "", "Jobs (+job=<name>):"]
    for name, text in JOB_HELP.items():
        lines += _entry(name, text, width, pad=10)
    for group in GROUPS_SHOWN:
        choices = group_choices(conf, group)
        if not choices:
            continue
        prefix = "+" if group == "experiment" else ""
        lines += ["", f"{prefix}{group}=<choice>:"]
        for n, t in choices:
            lines += _entry(n, t, width)
    lines += ["", "hydra/launcher=<choice> (sweeps, with -m):"]
    for n, t in sorted([*LAUNCHERS_IN_CODE, *group_choices(conf, "hydra/launcher")]):
        lines += _entry(n, t, width)
    lines += ["", "Any key is overridable: e.g. checkpoint.dir=./ck checkpoint.keep_last=3 dcp.broadcast.batch_bytes=64MiB",
              f"Show the composed config: {prog} +job=save --cfg job      Sweep: {prog} -m key=a,b",
              f"Shell completion: eval \"$({prog} -sc install=bash)\"     Hydra's own flags: --hydra-help"]
    return "\n".join(lines)


# One bash function for both ways of running the CLI; it asks the CLI itself (Hydra's query mode)
# for the candidates of the word under the cursor, then hands bash the part after the last break
# character ('=' or ':'), as bash's own word splitting expects.
COMPLETION_SCRIPT = r'''_hpdcp_runner_complete() {
    local line=${COMP_LINE:0:$COMP_POINT} rest
    local -a prog
    if [[ $line =~ ^[[:space:]]*(hpdcp)([[:space:]].*)?$ ]]; then
        prog=(hpdcp); rest=${BASH_REMATCH[2]}
    elif [[ $line =~ ^[[:space:]]*([^[:space:]]*python[0-9.]*)[[:space:]]+-m[[:space:]]+hpdcp_runner([[:space:]].*)?$ ]]; then
        prog=("${BASH_REMATCH[1]}" -m hpdcp_runner); rest=${BASH_REMATCH[2]}
    else
        return 1
    fi
    [[ -z $rest ]] && return 0
    local word=${rest##*[[:space:]]}
    local choices
    choices=$(COMP_LINE="hpdcp$rest" COMP_POINT=$((5 + ${#rest})) "${prog[@]}" -sc query=bash 2>/dev/null)
    COMPREPLY=($(compgen -W "$choices" -- "$word"))
    local piece=${COMP_WORDS[COMP_CWORD]}
    [[ $piece == "=" || $piece == ":" ]] && piece=""
    local cut=$(( ${#word} - ${#piece} ))
    local i
    for i in "${!COMPREPLY[@]}"; do COMPREPLY[$i]=${COMPREPLY[$i]:$cut}; done
}
complete -o nospace -o default -F _hpdcp_runner_complete hpdcp python python3
'''


_NOT_A_NAME = ("null", "choice(", "range(", "interval(", "glob(", "tag(", "sort(", "shuffle(", "${")


def unknown_choices(argv: list[str], conf_dir: str | None = None) -> list[str]:
    """One line per ``group=choice`` override naming a choice the group does not have (the
    internal ``*_schema`` entries are not choices). Skipped when the user adds config
    directories of their own (``hydra.searchpath``, ``--config-dir``), whose choices we cannot see."""
    if any(a.startswith(("hydra.searchpath", "--config-dir", "-cd")) for a in argv):
        return []
    conf = conf_dir or find_conf_dir()
    out = []
    for a in argv:
        if a.startswith("-") or "=" not in a:
            continue
        key, _, value = a.partition("=")
        group = key.lstrip("+~")
        if key.startswith("~") or "." in group or "/" in group or not os.path.isdir(os.path.join(conf, group)):
            continue
        names = [n for n, _ in group_choices(conf, group) if not n.endswith("_schema")]
        if not names or value.startswith(_NOT_A_NAME):  # sweep functions: Hydra checks their choices
            continue
        for v in value.split(","):  # a sweep lists several
            v = v.strip()
            if v and not v.startswith(_NOT_A_NAME) and v not in names:
                out.append(f"ConfigError: {group}={v}: no such choice; {group} is one of: {', '.join(names)}")
    return out


def unsupported_locations(argv: list[str]) -> list[str]:
    """One line per ``key=<scheme>://...`` override whose scheme no storage serves: refused before
    any rank starts (the launcher asks) or composes a config, naming the key."""
    from .dcp.tools import credentials_refused, location_refused

    out = []
    for a in argv:
        key, eq, value = a.partition("=")
        key = key.lstrip("+~")
        if a.startswith("-") or not eq or key.startswith("hydra.") or key.startswith("hydra/"):
            continue
        for v in value.split(","):  # a sweep lists several
            v = v.strip().strip("'\"")
            # a store's endpoint is an http(s) URL, not a location: only secrets in it are refused here
            why = credentials_refused(v) if key.rsplit(".", 1)[-1] == "endpoint" else location_refused(v)
            if why:
                out.append(f"ConfigError: {key}={why}")
    return out


def report_mistakes(argv: list[str], rank: int) -> bool:
    """Print (rank 0) the mistakes found in the command line before any config is composed; True
    when there were any. The launcher asks before it starts a rank, every rank again."""
    if any(a.split("=")[0] in PRINT_ONLY_FLAGS for a in argv):
        return False
    choices, locations = unknown_choices(argv), unsupported_locations(argv)
    if (choices or locations) and rank == 0:
        hint = ["  (python -m hpdcp_runner --help lists every group's choices)"] if choices else []
        print("\n".join([f"error: {line}" for line in choices + locations] + hint), file=sys.stderr)
    return bool(choices or locations)


def handle_early_flags(argv: list[str], rank: int) -> int | None:
    """Answer what needs no Hydra run; returns an exit code when handled, else None. A config
    group choice that does not exist is one line (printed once under torchrun) and exit 2, not
    Hydra's 20-line composition error on every rank with exit 1."""
    if report_mistakes(argv, rank):
        return 2
    if rank != 0 and any(a.split("=")[0] in PRINT_ONLY_FLAGS for a in argv):
        return 0  # torchrun: rank 0 prints it once
    if any(a in ("--help", "-h") for a in argv):
        prog = "hpdcp" if os.path.basename(sys.argv[0]) == "hpdcp" else "python -m hpdcp_runner"
        print(render_help(prog))
        return 0
    for i, a in enumerate(argv):
        if a in ("-sc", "--shell-completion") and i + 1 < len(argv) and argv[i + 1] == "install=bash":
            print(COMPLETION_SCRIPT)
            return 0
        if a in ("-sc", "--shell-completion") and i + 1 < len(argv) and argv[i + 1] == "uninstall=bash":
            print("complete -r hpdcp python python3 2>/dev/null; unset -f _hpdcp_runner_complete")
            return 0
    return None
