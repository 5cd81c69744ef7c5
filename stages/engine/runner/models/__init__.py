"""Model architectures, one module per family."""
