"""The torchrun entry point: the `asyncrl` CLI on rank 0, `follow()` on every other rank.

    torchrun --nnodes N --nproc-per-node G ... -m asyncrl.cli.launch train CONFIG [--set ...]

Only rank 0 runs the event loop; the other ranks hold their shards of the Megatron trainer and
run each call rank 0 announces (`asyncrl.trainer.megatron.launch`). See tools/launch_multinode.sh.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from asyncrl.trainer.megatron.launch import follow, world

    rank, _ = world()
    if rank == 0:
        from asyncrl.cli.main import main as cli_main

        return cli_main(argv)
    # a follower is a command-line process too: its log lines go to its console and its large
    # blocks are mapped on their own, as rank 0's
    from asyncrl import allocator
    from asyncrl import log as logmod

    allocator.configure()
    logmod.configure()
    follow()
    return 0


if __name__ == "__main__":
    sys.exit(main())
