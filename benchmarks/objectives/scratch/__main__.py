"""``python -m benchmarks.objectives.scratch [--quick] ...``: see ``main``."""

from benchmarks.objectives.scratch.main import main

if __name__ == "__main__":
    main()
