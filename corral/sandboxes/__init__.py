"""Sandboxes that bundle code runs in: local, bwrap, docker, e2b, kubernetes."""
