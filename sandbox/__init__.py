"""asyncrl's code-execution sandbox: a warm, contained Python executor pool.

Standalone: deployable on CPU nodes without the rest of asyncrl (never imports it).

- ``SandboxPool`` -- zygote workers forking one contained child per call (in-process use).
- ``sandbox serve`` (``sandbox.server``) -- the pool behind an aiohttp endpoint; a shared
  bearer token (``sandbox.auth``) is required off loopback; ``--front-ends N`` runs N HTTP
  processes on one port (``sandbox.frontends``).
- ``LocalSandboxClient`` / ``HttpSandboxClient`` -- one ``SandboxClient`` interface for both.

See ``sandbox.isolation`` for the threat model and ``sandbox.errors`` for the exception tree.
"""

from .client import HttpSandboxClient, LocalSandboxClient, SandboxClient
from .config import IsolationLevel, PoolConfig
from .errors import (
                     AuthError,
                     FunctionError,
                     FunctionTimeout,
                     IsolationUnavailable,
                     Overloaded,
                     PoolClosed,
                     SandboxError,
                     TransportError,
)
from .pool import SandboxPool
from .records import ExecRequest, ExecResult, ExecStatus, FunctionResult, FunctionStatus

__all__ = [
                     "AuthError",
                     "ExecRequest",
                     "ExecResult",
                     "ExecStatus",
                     "FunctionError",
                     "FunctionResult",
                     "FunctionStatus",
                     "FunctionTimeout",
                     "HttpSandboxClient",
                     "IsolationLevel",
                     "IsolationUnavailable",
                     "LocalSandboxClient",
                     "Overloaded",
                     "PoolClosed",
                     "PoolConfig",
                     "SandboxClient",
                     "SandboxError",
                     "SandboxPool",
                     "TransportError",
]
