class ModelLoadError(Exception):
    """A model path that cannot be served. The message is one line meant for the user."""
