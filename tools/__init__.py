"""Operator scripts (dataset preparation, checkpoint conversion, cluster launch helpers).

Not installed with the package: run them from a checkout, e.g. `python tools/prepare_data.py`.
"""
