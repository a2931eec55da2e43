"""The load planner: from a manifest and every rank's targets to a ``LoadPlan`` (``planner.build_plan``).

Pure and deterministic, the same on every rank: it imports only ``core`` (and ``errors``),
never ``storage``, ``formats``, ``loading``, ``saving``, ``comm``, ``cuda`` or ``torch.distributed``.
"""
