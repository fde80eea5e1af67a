"""The command line, `python -m kvdemo` (`main`), and what it prints without `--json` (`format`)."""
