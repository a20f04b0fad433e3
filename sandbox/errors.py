"""Exceptions raised by the sandbox package.

The tree (every class is importable from ``sandbox.errors``)::

    SandboxError                   base of everything this package raises
    ├── SandboxConfigError         a PoolConfig / CLI value is impossible (also a ValueError)
    ├── IsolationUnavailable       the isolation level asked for cannot be had on this host
    ├── WorkerStartError           zygote workers could not be started (import failure, jail error)
    ├── PoolClosed                 the pool or client was used after ``aclose()``
    ├── Overloaded                 the bounded queue is full; nothing was executed
    ├── TransportError             an HTTP sandbox node could not be reached or broke mid-request
    │   └── AuthError              a node refused the client's token (HTTP 401)
    ├── ProtocolError              a node or worker answered something that does not decode
    └── FunctionCallError          ``FunctionResult.unwrap()`` on a non-ok result
        ├── FunctionTimeout        the hosted function ran past its deadline and was killed
        └── FunctionError          the hosted function raised (or the result did not pickle)

What is *not* an exception: the outcome of model-written code. ``execute`` answers every call
with an ``ExecResult`` whose status is ok / error / timeout / killed / sandbox_failure; a worker
dying, a node going away after all retries, or an overload seen by a client become
``sandbox_failure`` results with a ``detail``, so one bad call never kills a rollout group.
"""

from __future__ import annotations


class SandboxError(Exception):
    """Base class of every exception raised by the sandbox package."""


class SandboxConfigError(SandboxError, ValueError):
    """A configuration value is invalid; the message names the field."""


class IsolationUnavailable(SandboxError):
    """The requested isolation level cannot be provided; nothing is silently downgraded."""


class WorkerStartError(SandboxError):
    """A zygote worker failed to start or to report ready in time."""


class PoolClosed(SandboxError):
    """The pool or client has been closed."""


class Overloaded(SandboxError):
    """The bounded queue is full. The call was not executed and may be retried later."""


class TransportError(SandboxError):
    """An HTTP sandbox node could not be reached, or the connection broke mid-request."""


class AuthError(TransportError):
    """A node answered 401: the client's token is missing or not the node's."""


class ProtocolError(SandboxError):
    """A message from a worker or a node could not be decoded."""


class FunctionCallError(SandboxError):
    """A hosted function call did not return a value (see ``FunctionResult.unwrap``)."""


class FunctionTimeout(FunctionCallError):
    """The hosted function ran past its deadline and its process was killed."""


class FunctionError(FunctionCallError):
    """The hosted function raised, or its result could not be pickled back."""
