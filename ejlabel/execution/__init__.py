"""Running calls: the executor, batching, recording, and tuning (:mod:`.tuning`: isolated, in
context, and on remote workers).

Imports from the layers below (:mod:`ejlabel.utils`, :mod:`ejlabel.core`, :mod:`ejlabel.config`).
"""
