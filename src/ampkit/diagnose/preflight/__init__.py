"""``ampkit preflight``: which low-precision format each layer can take, before training (``api.preflight_model``)."""
