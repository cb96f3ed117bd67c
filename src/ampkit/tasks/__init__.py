"""Built-in tasks: real models on data that ships with Python or scikit-learn (no downloads)."""
