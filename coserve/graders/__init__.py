"""OpenAI's graders, run in-process: templates, checks, similarity, formulas, sandboxed python, rollouts.
Imported by: jobs, api, actors, offline, server, bench."""
