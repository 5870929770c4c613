"""Custom kernels for the model families: one sub-package per operator (reference, kernel, dispatch).

This package imports nothing else of ours; `workers` imports it.
"""
