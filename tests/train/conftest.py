"""The train tests' helper modules (_launch, _dist_jobs, fastclip_oracle) live in this folder and are
imported by bare name from the tests in its subfolders (the venv ships an unrelated ``tests`` package)."""

import sys
from pathlib import Path

HERE = str(Path(__file__).parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
