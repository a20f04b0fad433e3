"""asyncrl: agentic RL with a Python tool (the rStar2-Agent method), asyncio-first.

The embeddable surface (`from asyncrl import ...`) is the async rollout engine: engines,
tools, the agent loop, the scheduler and the records they produce.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("asyncrl")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+local"

__all__ = ["__version__"]
