"""The ``ejlabel`` command and its demo.

The top layer: it may import everything, including ``ejlabel.kernels``, ``ejlabel.analysis`` and
the example model (:mod:`ejlabel.examples`, which the demo runs); nothing below imports it.
"""
