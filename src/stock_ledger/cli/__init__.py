"""The command line: one declaration of every command, its flags and the variables it reads (`commands`), and the
one entry point that runs it (`main`).

May import everything: it is the top of the house.
"""

from stock_ledger.cli.main import main

__all__ = ["main"]
