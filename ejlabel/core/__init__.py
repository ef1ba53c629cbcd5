"""The label format, ``Kernel`` / ``Invocation``, and the self-describing call descriptions.

Imports only from :mod:`ejlabel.utils`; never from the layers above, ``kernels`` or ``analysis``.
"""
