"""Where configs come from: the memory cache, the persistent SQLite cache, policies, selection.

Imports from :mod:`ejlabel.utils` and :mod:`ejlabel.core`. Tuning lives above this layer; the
selector reaches it through the :class:`~ejlabel.config.selection.TuneHook` interface it is given.
"""
