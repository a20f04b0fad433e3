"""Code that runs inside the zygote worker processes (and their forked children).

Self-contained on purpose: it imports only the standard library and msgspec, never the rest of
the ``sandbox`` package, so the jail can mount just this directory. Loaded as the top-level
package ``_sandbox_runtime`` inside workers (see ``sandbox.isolation``).
"""
