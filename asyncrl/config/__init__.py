"""Run configuration: the schema (`schema`, the components' sections in `components`, the
stage sections in `stages`, the shared types in `base`) and loading it from TOML (`loading`).

`from asyncrl.config import RunConfig, load` is the usual use; every public name of its
modules is here. Imports nothing from the project but `errors`, and no torch.

Variants (engine, trainer, sandbox) are tagged unions on the `kind` key; msgspec resolves the
tag, so an unknown kind is an error that names `engine.kind`.
"""

from asyncrl.config.base import (
    Fraction,
    NonNegFloat,
    NonNegInt,
    PosFloat,
    PosInt,
)
from asyncrl.config.components import (
    EngineConfig,
    LocalEngineConfig,
    LocalSandboxConfig,
    LoraSection,
    MegatronTrainerConfig,
    RemoteSandboxConfig,
    SandboxConfig,
    SGLangEngineConfig,
    TorchTrainerConfig,
    TrainerConfig,
    VLLMEngineConfig,
)
from asyncrl.config.loading import (
    apply_overrides,
    dump_json,
    from_dict,
    load,
    to_dict,
    write_resolved,
)
from asyncrl.config.schema import (
    AlgorithmSection,
    CheckpointSection,
    DataSection,
    EvalSection,
    LoggingSection,
    ModelSection,
    RocSection,
    RolloutSection,
    RunConfig,
    RunSection,
    TaskSection,
    TokenizerSection,
)
from asyncrl.config.stages import (
    DistillSection,
    PlateauRule,
    SFTChatSection,
    StageSection,
    TeacherSection,
)

__all__ = [
    "AlgorithmSection",
    "CheckpointSection",
    "DataSection",
    "DistillSection",
    "EngineConfig",
    "EvalSection",
    "Fraction",
    "LocalEngineConfig",
    "LocalSandboxConfig",
    "LoggingSection",
    "LoraSection",
    "MegatronTrainerConfig",
    "ModelSection",
    "NonNegFloat",
    "NonNegInt",
    "PlateauRule",
    "PosFloat",
    "PosInt",
    "RemoteSandboxConfig",
    "RocSection",
    "RolloutSection",
    "RunConfig",
    "RunSection",
    "SFTChatSection",
    "SGLangEngineConfig",
    "SandboxConfig",
    "StageSection",
    "TaskSection",
    "TeacherSection",
    "TokenizerSection",
    "TorchTrainerConfig",
    "TrainerConfig",
    "VLLMEngineConfig",
    "apply_overrides",
    "dump_json",
    "from_dict",
    "load",
    "to_dict",
    "write_resolved",
]
