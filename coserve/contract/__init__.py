"""The wire contract: the plain dataclasses that cross a process or package boundary, and nothing else.
Imported by: every package (it imports none of coserve).

The wire contract: the plain dataclasses that cross processes, and nothing else.

gateway -> scheduler: `messages` (submissions, admissions, stream batches); scheduler <-> engine:
`plan` (`IterationPlan`, `IterationResult`), `training_plan` (the fine-tuning work and its reports) and
`engine` (the `Engine` protocol, its `RuntimeLayout`, `EngineFailure`); job manager <-> a dedicated
Ray Train run: `dedicated_run` (`RunSpec`, `Command`, `RunUpdate`); what they carry: `sampling`
(`SamplingParams`, `AdapterRef`, `EosIds`), `structured_output`, `training_settings`. Torch-free; a
second engine backend implements `engine.Engine` against these types."""
