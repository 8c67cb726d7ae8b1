"""``python -m benchmarks.objectives.reference [--quick] ...``: see ``main``."""

from benchmarks.objectives.reference.main import main

if __name__ == "__main__":
    main()
