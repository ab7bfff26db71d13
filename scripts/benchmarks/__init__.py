"""The subcommands of scripts/bench.py, one module each (growth.py: growth and scale-out; soak.py: soak and
verify)."""
