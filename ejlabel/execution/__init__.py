"""Running calls: the executor, batching, recording and tuning (isolated and in context).

Imports from the layers below (:mod:`ejlabel.utils`, :mod:`ejlabel.core`, :mod:`ejlabel.config`).
"""
