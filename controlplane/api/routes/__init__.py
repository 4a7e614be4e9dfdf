"""One module per resource; api/main.py gathers them under /api/v1."""
