"""The systems a benchmark compares, each run as its own process in its own virtual environment.

A runner (`python -m benchmarks.peers.run_<system> JOB RESULT`) reads a job (JSON: the model
directory, the adapters, the workloads as token ids), loads its system once, runs every
workload `repeats` times, and writes the seconds and the generated token ids (JSON). Runners
import only the standard library from this package, so any peer's environment can run them.
"""
