"""The ``ejlabel`` command, its demo and the example model.

The top layer: it may import everything, including ``ejlabel.kernels`` and ``ejlabel.analysis``;
nothing in the core imports it.
"""
