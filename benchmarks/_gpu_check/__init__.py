"""The pieces of ``benchmarks/gpu_check.py``, one concern per module.

``shapes`` the model shapes and workload sizes (real sizes on a GPU, tiny ones with ``--quick``);
``models`` the random models and adapters built on the machine; ``context`` what every part gets (device,
sizes, models, time left); ``record`` a part's checks and the JSON / markdown report; ``environment`` what
the bare machine lacks and what ran; ``runner`` the parts in turn under the time budget, each one's
failure caught; ``coserve_side`` and ``hf_side`` the two engines' calls (transformers + peft as the
reference); one ``part_*`` module per part.
"""
