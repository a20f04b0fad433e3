"""Run under torchrun (2 processes, gloo, tensor parallel 2) by `test_signal_save.py`.

usage: torchrun --nproc_per_node 2 signal_worker.py OUT_DIR

Rank 0 drives a Megatron trainer through `launch.make_trainer` (as `asyncrl train` does) with
the stop handlers of `asyncrl.stopping` installed, writes OUT_DIR/ready, and waits for a stop.
The test then sends SIGTERM to torchrun, which forwards it to every rank. Rank 0 saves a
checkpoint through the proxy (the follower must still be there to write its shard), then
closes the follower; rank 1 runs `launch.follow()`.
"""

from __future__ import annotations

import asyncio
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")


def main(out: Path) -> None:
    import torch

    from asyncrl.checkpoint import save_checkpoint
    from asyncrl.config import AlgorithmSection, MegatronTrainerConfig
    from asyncrl.errors import RunStopped
    from asyncrl.log import configure
    from asyncrl.stopping import StopRequest, signal_handlers
    from asyncrl.trainer.megatron import launch

    torch.set_num_threads(1)
    configure()  # as the torchrun entry point (`asyncrl.cli.launch`) does on every rank
    rank, _ = launch.world()
    if rank != 0:
        launch.follow()
        return
    cfg = MegatronTrainerConfig(tensor_parallel=2, micro_batch_tokens=64, recompute="none")
    proxy = launch.make_trainer(str(out / "init"), cfg, AlgorithmSection(lr=1e-3),
                                pad_token_id=0)

    async def drive() -> None:
        stop = StopRequest()
        with signal_handlers(stop, 60.0):
            (out / "ready").write_text("1")
            try:
                await stop.race(asyncio.sleep(120))
            except RunStopped:
                pass
            assert stop.name == "SIGTERM", stop.name
            await asyncio.sleep(1.0)  # the follower has had its SIGTERM by now
            await asyncio.to_thread(save_checkpoint, out, 1, proxy, {"stopped_by": stop.name})
        proxy.close()

    asyncio.run(drive())


if __name__ == "__main__":
    from asyncrl.trainer.megatron.cpu_compat import cpu_megatron

    with cpu_megatron():
        main(Path(sys.argv[1]))
