"""The portable profile: a request's affine traces as JSON, traced where the model's code is and answered
anywhere without it (``profile.py``: the document; ``replayer.py``: the planner's step source over it).
Torch-free."""
