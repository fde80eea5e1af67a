"""`python -m kvdemo`: the command line (`kvdemo.cli.main`)."""

from kvdemo.cli.main import main

if __name__ == "__main__":
    main()
