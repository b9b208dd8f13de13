"""Benchmark workloads and reports (no JAX here): used by `jaxserve bench`."""
