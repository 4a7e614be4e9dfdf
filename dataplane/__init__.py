"""Data plane: the engine and the model server."""
