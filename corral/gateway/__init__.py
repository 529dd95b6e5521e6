"""The OpenAI chat gateway: sessions, turn recording, sample merging, templates and parsers."""
