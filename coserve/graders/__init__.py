"""OpenAI's graders, run in-process: templates, string checks, text similarity (maintained metric libraries)
and multi-grader formulas. Pure Python, no torch."""
