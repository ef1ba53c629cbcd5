"""The library's version: the one home of the number (``pyproject.toml`` reads it from here).

It salts every call key (:mod:`ejlabel.utils.fingerprint`), so a new release never reuses a
config cached under an older one's keys.
"""

VERSION = "0.1.0"
