"""``python -m toolkit`` is the ``toolkit`` command."""

from toolkit.cli.main import main

main()
