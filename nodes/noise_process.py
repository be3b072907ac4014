"""The model's noise process as the engine compares it (`carnator_core.lookup.noise_process`), read from ComfyUI's
model-sampling object."""

from __future__ import annotations

import torch

from carnator_core.lookup.noise_process import NoiseProcess


def noise_process(model_patcher) -> NoiseProcess:
    """The model's noise process: its model-sampling classes (ComfyUI builds the object from a sampling kind and a
    prediction type, under a name of its own) and its σ-to-timestep mapping."""
    model_sampling = model_patcher.get_model_object("model_sampling")
    kind = "+".join(cls.__name__ for cls in type(model_sampling).__mro__[1:]
                    if cls.__module__.startswith("comfy.") and cls.__name__ != "Module")

    def timestep_of(sigmas) -> list[float]:
        buffer = next(iter(model_sampling.buffers()), None)  # its tables live where the model was loaded
        with torch.no_grad():
            values = torch.as_tensor(list(sigmas), dtype=torch.float32,
                                     device=buffer.device if buffer is not None else None)
            return [float(t) for t in model_sampling.timestep(values).flatten().tolist()]

    return NoiseProcess(kind=kind, timestep_of=timestep_of)
