"""Evaluation layer: generation and scoring (generate), statistics (stats), held-out sets and eval.json (run),
side-by-side comparisons (compare)."""
