"""Token ids as text, for the sample view: each id decoded on its own with the run's
tokenizer (``--tokenizer``, else the run's ``model.path`` when it is a folder on disk).

transformers is optional here (``corral[gateway]`` has it, a bare install has not): without
it, or without a tokenizer folder, the page shows ids.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

Pieces = Callable[[Sequence[int]], list[str]]


def load_pieces(folder: Path | None) -> Pieces | None:
    """A function from ids to their texts with the tokenizer in ``folder``; ``None`` when
    there is no folder, no transformers, or no tokenizer in it."""
    if folder is None or not folder.is_dir():
        return None
    try:
        from transformers import AutoTokenizer
    except ImportError:
        return None
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError):
        return None
    return _cached_decoder(tokenizer)


def _cached_decoder(tokenizer: Any) -> Pieces:
    # One decode per distinct id, ever: a 32,000-token sample has a few thousand distinct ids.
    seen: dict[int, str] = {}

    def pieces(ids: Sequence[int]) -> list[str]:
        out = []
        for i in ids:
            text = seen.get(i)
            if text is None:
                text = seen[i] = tokenizer.decode([i], skip_special_tokens=False)
            out.append(text)
        return out

    return pieces


def tokenizer_folder(config: dict[str, Any] | None) -> Path | None:
    """A run's model folder from its ``config.json`` (``model.path``), if it names one."""
    model = (config or {}).get("model")
    path = model.get("path") if isinstance(model, dict) else None
    return Path(path) if isinstance(path, str) else None
