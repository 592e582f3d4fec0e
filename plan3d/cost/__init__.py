"""Cost models: small pure functions, one formula each, source cited in the docstring."""
