"""The local engine: a transformers model serving SGLang's native API (CPU or GPU). Not SGLang."""
