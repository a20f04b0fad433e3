"""The local engine's record of the experts an MoE model's routers chose (routing replay).

Owns: a forward hook on every router of the engine's model that keeps the expert indices of
the last forward (`RouterTap.take`: `[tokens of the forward, layers, top_k]`), and the
encoding of one request's rows as a `records.RoutedExperts`. Does not own: which rows belong
to which request, or when a request's record restarts (the engine: a prefill, also after a
preemption, replaces it; each decode step appends the row of the token it fed), nor the
replay itself (`asyncrl.trainer.moe_replay`).

Row order is the model's: a forward over `[B, T]` ids routes its tokens flattened row-major
(`B * T` rows), which is how transformers' sparse MoE blocks flatten them for their router.
"""

from __future__ import annotations

from typing import Any

from asyncrl.errors import EngineError
from asyncrl.modeling import moe_shape, routers
from asyncrl.records import RoutedExperts


class RouterTap:
    """Hooks on the routers of `model`; `take()` after each forward, `encode` per request."""

    def __init__(self, torch: Any, model: Any, name: str) -> None:
        shape = moe_shape(model.config)
        mods = routers(model)
        if shape is None or not mods:
            raise EngineError(f"{name}: routing replay needs a mixture-of-experts model; "
                              f"{type(model).__name__} has no experts")
        layers, top_k, experts = shape
        if len(mods) != layers:
            raise EngineError(f"{name}: {len(mods)} router modules for {layers} sparse layers "
                              "in the config: cannot record routing for this model")
        self.layers, self.top_k = layers, top_k
        self.itemsize = 1 if experts < 255 else 2
        self._torch = torch
        self._dtype = torch.uint8 if self.itemsize == 1 else torch.int32
        self._got: list[Any] = [None] * layers
        self._handles = [m.register_forward_hook(self._hook(i)) for i, m in enumerate(mods)]

    def _hook(self, i: int) -> Any:
        def keep(_mod: Any, _args: Any, out: Any) -> None:
            self._got[i] = out[2]

        return keep

    def take(self) -> Any:
        """The last forward's choices, `[tokens, layers, top_k]` on the CPU (a compact dtype)."""
        got, self._got = self._got, [None] * self.layers
        if any(g is None for g in got):
            raise EngineError("a forward did not call every router")
        return self._torch.stack([g.to(self._dtype) for g in got], dim=1).cpu()

    def encode(self, rows: list[Any]) -> RoutedExperts:
        """One request's rows (its prefill block, then one row per decode step) as a record."""
        data = b""
        if rows:
            arr = self._torch.cat(rows).numpy()
            data = arr.astype("<u1" if self.itemsize == 1 else "<u2").tobytes()
        return RoutedExperts(layers=self.layers, top_k=self.top_k, itemsize=self.itemsize,
                             data=data)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
