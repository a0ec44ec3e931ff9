"""Subcommands of this package (registered into `moejax` by `register`)."""


def register(sub) -> None:
    """Add this package's subparsers to the `moejax` command."""
