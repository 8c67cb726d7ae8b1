"""``python -m benchmarks.objectives.convergence [--quick] ...``: see ``main``."""

from benchmarks.objectives.convergence.main import main

if __name__ == "__main__":
    main()
