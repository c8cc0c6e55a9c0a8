"""The command line: the Typer app and its commands, and the boundary where errors and
signals become messages and exit codes."""
