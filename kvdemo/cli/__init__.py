"""The command line, `python -m kvdemo` (`main`): the `ask` command and the case questions (`ask`), and what it
prints without `--json` (`format`)."""
