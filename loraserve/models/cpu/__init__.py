"""The CPU platform (platform.py): compiled kernels, the weights' forms, the native decode step."""
