"""Quantized checkpoints as users download them (AWQ, GPTQ, compressed-tensors, fp8):
`config` reads a config.json's `quantization_config` into a `QuantFormat` (refusing
what the engine cannot serve, naming the field and value); `formats` unpacks each
format's tensors into one canonical form, dequantizes it, and packs float weights in
each format's storage (the tests' checkpoints).

Host logic in numpy: no JAX here, so the CLI and the configuration read it."""
