"""`difftune plan`: predicted peak accelerator memory of a config, per phase, and the cheapest levers that fit.

- `architecture.py`: the real architecture a config trains (meta-device models, bytes per precision).
- `measure.py`: measures saved activations and peak live bytes on the CPU (re-fits `coefficients.py`).
- `coefficients.py`: the measured per-token activation coefficients, per block kind.
- `predict.py`: the per-phase prediction (caching, training, validation).
- `crepa.py`: what crepa_enabled adds to training and validation (DINOv2, the resident VAE, the projector).
- `levers.py`: the cheapest set of memory levers that fits a given accelerator.
- `render.py`: the console tables of `difftune plan`.
"""
