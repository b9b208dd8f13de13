"""Structured output: grammars that constrain what a request may generate.

Host logic only (no JAX): the device side is the sampler's allowed-token bitmask.
"""

from jaxserve.structured.compiler import GrammarCompiler, GrammarMatcher
from jaxserve.structured.grammar import either, spec_key, then, to_grammar

__all__ = ["GrammarCompiler", "GrammarMatcher", "either", "spec_key", "then", "to_grammar"]
