"""Engines: the engine protocol (SGLang's native API), its HTTP client and the local engine."""
