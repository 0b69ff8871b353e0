"""The `realloop` command line. Heavy imports live inside commands, so --help is instant."""

from __future__ import annotations

import typer

from flows import cell

app = typer.Typer(
    help="realloop: real line logs in, gated and promoted models out to the edge box.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
app.add_typer(cell.app, name="cell")

if __name__ == "__main__":
    app()
