"""`python -m kvdemo`: the command line (`kvdemo.cli.main`)."""

from kvdemo.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())  # the shell sees main()'s status: 0, 2 on bad input, 1 on a failure at run time
