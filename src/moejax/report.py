"""`moejax report RUN_DIR`: PNG plots of a run's metrics."""


def register(sub) -> None:
    """Add the `report` subparser to the `moejax` command."""
