"""Command-line entry points (absl flags). The only layer that reads flags or env."""
