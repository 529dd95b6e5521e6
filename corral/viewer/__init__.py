"""``corral view``: a read-only web page over a run, eval or play folder (or a live gateway).

:mod:`corral.viewer.reader` reads the folders (plain functions, no HTTP);
:mod:`corral.viewer.app` serves them as JSON next to the static page in ``static/``;
:mod:`corral.viewer.redact` strips secrets from everything the API returns.
"""
