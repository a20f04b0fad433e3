"""The `asyncrl` command line (`asyncrl.cli.main:main`) and the torchrun entry (`launch`).

Each command is a thin module over the library: it parses arguments, calls one library entry
(`asyncrl.train.train_async`, `asyncrl.prepare`, ...), and prints what a person needs. Nothing
in the library imports this package.
"""
