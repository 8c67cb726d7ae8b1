"""Sections of ``scripts/gpu_check.py``: one module per section, each ``run(ctx) -> None`` filling its
``Section`` (rows, skipped cases, notes) and stopping at the section's time budget."""
