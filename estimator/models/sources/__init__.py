"""The model sources, one module (or package) each; every one registers itself (``estimator.models.registry``)."""
