"""The bottom layer: fingerprints and devices, JSON serialisation, launch parameters.

Nothing here imports another ``ejlabel`` layer.
"""
