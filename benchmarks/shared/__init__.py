"""Helpers shared by benchmark families: the process-tree runner with memory accounting, open_clip log
parsing."""
