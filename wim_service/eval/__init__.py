"""Answer-quality evaluation: generated long-context tasks, methods side by side, reports."""
