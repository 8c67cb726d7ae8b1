"""``python -m toolkit`` is the ``toolkit`` command."""

from toolkit.cli.main import main

if __name__ == "__main__":  # worker processes that re-import __main__ must not rerun the CLI
    main()
