"""The float precision of the VAE and of fp32 matmuls (`vae_dtype`, `disable_tf32`): the fields, mixed into
TrainConfig. Import-light: no torch. `vae_dtype` acts in the families' `load` (models/vae_dtype.py),
`disable_tf32` in train/torch_options.py.

SimpleTuner's names and values. Two defaults differ, and the descriptions say so: SimpleTuner's `vae_dtype:
default` puts the VAE in bf16 whatever the weights' dtype, difftune keeps the weights' dtype; and SimpleTuner
switches TF32 on unless `disable_tf32` is true, difftune leaves torch's own settings unless the key is set.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, field_validator

from difftune.config.fields import field

VAE_DTYPES = ("bf16", "fp16", "fp32")


class PrecisionKeys(BaseModel):
    vae_dtype: Literal[VAE_DTYPES] | None = field(  # type: ignore[valid-type]
        None, "Dtype of the VAE's weights and computation, for caching latents, on-the-fly encoding, image-to-image "
        "inputs and decoding validation samples: 'bf16', 'fp16' or 'fp32' ('fp32' avoids bf16's faint banding "
        "and fp16's overflow, for twice the VAE memory of bf16). Inputs in another dtype are cast to it; latents "
        "are cached in fp32 as always, so an fp32 VAE's keep their precision, and latents of another VAE dtype are "
        "cached apart. Empty or 'default': the weights' dtype (base_model_default_dtype, else mixed_precision; "
        "SimpleTuner's 'default' is bf16 instead).", "memory",
        advanced=True,
    )
    disable_tf32: bool | None = field(
        None, "NVIDIA GPUs (Ampere or newer): true computes fp32 matmuls and cuDNN convolutions in full IEEE fp32; "
        "false lets them use TF32 (faster, about 10 bits of mantissa), as SimpleTuner does by default (torch "
        "applies the matmul setting to CPUs with TF32 units too). Empty: torch's defaults (fp32 matmuls in IEEE "
        "fp32, cuDNN convolutions in TF32). Applied after caching, so cached latents never depend on it. bf16/fp16 "
        "work (autocast matmuls, bf16 weights) is not affected.", "memory", advanced=True,
    )

    @field_validator("vae_dtype", mode="before")
    @classmethod
    def _vae_dtype_default(cls, value: Any) -> Any:
        """SimpleTuner writes 'default' (or 'none') for "the VAE's usual dtype"."""
        return None if isinstance(value, str) and value.strip().lower() in ("default", "none", "") else value
