"""``python -m pipetrain``: the same as the ``pipetrain`` command."""

from pipetrain.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
