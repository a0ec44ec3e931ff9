"""The commands the docs show are the CLI's: a user copies them. Every `moejax …` line of a code block in README.md
and docs/*.md (LOG.md aside) parses, with its config resolved where it names a preset; every flag an inline
`moejax …` span names is one of its command's; and the plans docs/LAUNCH.md quotes print its figures."""

import re
import shlex
from pathlib import Path

import pytest

from moejax import cli
from moejax.ladder.cli import plan_config
from moejax.presets import preset

REPO = Path(__file__).resolve().parents[1]
DOCS = ["README.md", "docs/LAUNCH.md", "docs/EXPORT.md", "docs/ARCHITECTURE.md"]
# A usage line's placeholders, as a user would fill them in
PLACEHOLDERS = {"N": "8", "TEXT": "hi", "STEP": "2", "PRESET": "tiny", "section.field=value": "train.steps=8"}
_INVOCATION = re.compile(r"(?:^|[\s;&|(])moejax\s+([a-z].*)")


def _filled(usage: str) -> str:
    """`plan PRESET [--mfu 0.225] [--lower | --compile]` -> `plan tiny --mfu 0.225 --lower`: every optional part
    in, the first of alternatives, placeholders filled."""
    usage = usage.replace("…", "").replace("...", "")
    usage = re.sub(r"\[([^\[\]]*)\]", lambda m: re.split(r"\s*\|\s*(?=-)", m.group(1))[0], usage)
    usage = re.sub(r"([^\s|]+)(\|[^\s|]+)+", r"\1", usage)  # bf16|fp32 -> bf16
    return " ".join(PLACEHOLDERS.get(w, w) for w in usage.split(" "))


def _block_commands() -> list[tuple[str, list[str]]]:
    """(doc, argv after `moejax`) of every invocation in a fenced code block, continuations joined, comments and
    what follows a `;`, `&&` or `|` cut."""
    out = []
    for doc in DOCS:
        for block in re.findall(r"```[^\n]*\n(.*?)```", (REPO / doc).read_text(), re.S):
            for line in re.sub(r"\\\n\s*", " ", block).splitlines():
                m = _INVOCATION.search(line)
                if m:
                    words = shlex.split(_filled(m.group(1)), comments=True)
                    cut = next((i for i, w in enumerate(words) if w in (";", "&&", "||", "|")), len(words))
                    out.append((doc, words[:cut]))
    return out


def _inline_commands() -> list[tuple[str, list[str]]]:
    """(doc, words after `moejax`) of every inline `moejax SUB …` span in the prose."""
    out = []
    for doc in DOCS:
        prose = re.sub(r"```.*?```", "", (REPO / doc).read_text(), flags=re.S)
        out += [(doc, shlex.split(span)) for span in re.findall(r"`moejax ([a-z][^`\n]*)`", prose)]
    return out


def _resolves(args) -> None:
    """A command naming a preset builds its config as the command does (unknown keys, bad values raise): `train`
    with --steps/--remat too, `plan` and `data check` from --mesh and --set."""
    if args.cmd == "train":
        cli._resolve(args)
    elif getattr(args, "preset", None) and hasattr(args, "set"):
        plan_config(preset(args.preset), args.set or [], getattr(args, "mesh", None))


def _options(parser, path: str) -> set[str]:
    """The option strings of subcommand `path` ("train", "data prepare")."""
    for name in path.split():
        action = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
        parser = action.choices[name]
    return {s for a in parser._actions for s in a.option_strings}


BLOCKS = _block_commands()
INLINE = _inline_commands()


def test_the_docs_show_commands_of_every_kind():
    """The extraction itself: the docs' quick start, launch and export commands are found."""
    found = {argv[0] for _, argv in BLOCKS}
    assert {"train", "plan", "data", "ladder", "generate", "export", "summary", "report", "count"} <= found
    assert len(BLOCKS) >= 15 and len(INLINE) >= 20


@pytest.mark.parametrize("doc,argv", BLOCKS, ids=[f"{d}:{' '.join(a)[:60]}" for d, a in BLOCKS])
def test_every_command_in_a_code_block_parses_and_resolves(doc, argv):
    try:
        args = cli.build_parser().parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"{doc}: `moejax {' '.join(argv)}` does not parse (exit {e.code})")
    _resolves(args)


@pytest.mark.parametrize("doc,words", INLINE, ids=[f"{d}:{' '.join(w)[:60]}" for d, w in INLINE])
def test_every_flag_an_inline_command_names_is_its_commands(doc, words):
    """Prose shortens commands (`moejax plan --lower`, `moejax train --init-from exports/demo …`): the flags must
    exist; a span that is a whole command also parses and resolves."""
    sub = " ".join(words[:2] if words[0] in ("data", "ladder") and len(words) > 1 else words[:1])
    unknown = {w.split("=")[0] for w in words if w.startswith("--")} - _options(cli.build_parser(), sub)
    assert not unknown, f"{doc}: `moejax {sub}` has no {sorted(unknown)}"
    try:
        args = cli.build_parser().parse_args(words)
    except SystemExit:
        return  # shorthand, not a whole command
    _resolves(args)


@pytest.mark.parametrize("argv,code,quote,figure", [
    (["plan", "d768", "--cluster", "h100x8", "--mesh", "expert=8", "--set", "train.batch_size=128"], 0,
     "128 need 37 GB", r"fits: (36\.[5-9]|37\.[0-4]) of 80 GB HBM"),
    (["plan", "d768", "--cluster", "h100x8", "--mesh", "expert=8"], 1,
     "on 8 H100s they need 277 GB a GPU", r"total HBM\s+(276\.[5-9]|277\.[0-4])\d* GB"),
    (["plan", "d768", "--cluster", "h100x8"], 2, "exit 2 with numbers when the cluster is too small", r"64 devices"),
    (["plan", "hero"], 0, "moejax plan hero ", r"fits: "),
])
def test_the_plans_launch_md_quotes_print_its_figures(argv, code, quote, figure, capsys):
    doc = " ".join((REPO / "docs" / "LAUNCH.md").read_text().split())  # prose lines joined
    assert "moejax " + " ".join(argv[:4]) in doc and quote in doc
    rc = cli.main(argv)
    out = capsys.readouterr()
    assert rc == code, out.err
    assert re.search(figure, out.out + out.err), (out.out + out.err)[-2000:]
