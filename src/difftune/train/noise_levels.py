"""Noise-level draws beside diffusers' `compute_density_for_timestep_sampling`: the Beta schedule
(`flow_use_beta_schedule`) and a fixed list (`flow_custom_timesteps`), drawn from at random or taken in turn
(`flow_timesteps_mode: round-robin`). objective.sample_sigmas picks them.

Round-robin keeps no cursor: sample j of the global batch of micro-batch `micro` of optimizer step `step` (steps
done so far) is the run's sample number (step * accumulation + micro) * global batch + j, and takes level number
(that number mod the list's length). A resume, which restores `step`, continues the cycle exactly; each process
takes its slice of the global batch's levels as it does of the noise. A global batch smaller than the others (the
last of an epoch, if any) shifts the cycle by its shortfall: the cycle stays a function of progress alone.

Every draw comes from the run's own generator, on its device, so that a checkpoint (which saves the generator's
state) resumes the same sequence, and no draw waits on the host. torch's Beta and Gamma samplers take no generator,
so the Beta draw is built from ones that do:

    Beta(a, b) = X / (X + Y),  X ~ Gamma(a), Y ~ Gamma(b).

Each Gamma(a) draw is Marsaglia and Tsang's (2000) method for shape a + 1 >= 1, brought down to shape a by the
factor U^(1/a) of their paper: with d = a + 1 - 1/3, c = 1 / sqrt(9d), a normal x and a uniform u, the candidate
d (1 + c x)^3 is accepted when log u < x^2 / 2 + d - d v + d log v (v = (1 + c x)^3 > 0). For shape >= 1 it accepts
more than 95% of candidates; `TRIES` candidates are drawn at once and the first accepted one taken, with no loop
and no device-to-host read. All TRIES rejected (under 1e-20 per draw) takes v = 1, the Gamma's mode: a bias far
below anything measurable. The ratio is taken in log space (sigmoid(log X - log Y)), so small shapes, whose draws
underflow float32, still give levels in [0, 1].
"""

from __future__ import annotations

import math

import torch

TRIES = 16  # Marsaglia-Tsang candidates per draw


def _uniform_open(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """Uniform draws in (0, 1]: 1 - U[0, 1), so that their logarithm is finite."""
    return 1.0 - torch.rand(shape, generator=generator, device=generator.device)


def log_gamma_draws(n: int, shape: float, generator: torch.Generator) -> torch.Tensor:
    """log of n Gamma(shape, 1) draws [n] (float32), from `generator` only."""
    d = shape + 1.0 - 1.0 / 3.0
    c = 1.0 / math.sqrt(9.0 * d)
    x = torch.randn((TRIES, n), generator=generator, device=generator.device)
    u = _uniform_open((TRIES, n), generator)
    v = (1.0 + c * x) ** 3
    log_v = torch.log(v.clamp_min(torch.finfo(v.dtype).tiny))
    accepted = (v > 0) & (torch.log(u) < 0.5 * x * x + d - d * v + d * log_v)
    first = accepted.to(torch.uint8).argmax(dim=0, keepdim=True)  # the first True of each column (0 when none)
    chosen = torch.where(accepted.any(dim=0), log_v.gather(0, first)[0], torch.zeros_like(log_v[0]))
    boost = _uniform_open((n,), generator)  # Gamma(shape) = Gamma(shape + 1) * U^(1/shape)
    return math.log(d) + chosen + torch.log(boost) / shape


def beta_draws(n: int, alpha: float, beta: float, generator: torch.Generator) -> torch.Tensor:
    """n draws [n] of Beta(alpha, beta), in [0, 1], from `generator` only."""
    return torch.sigmoid(log_gamma_draws(n, alpha, generator) - log_gamma_draws(n, beta, generator))


def list_draws(n: int, levels: tuple[float, ...], generator: torch.Generator) -> torch.Tensor:
    """n noise levels [n], each one of `levels` drawn uniformly, from `generator`."""
    table = torch.tensor(levels, dtype=torch.float32, device=generator.device)
    return table[torch.randint(len(levels), (n,), generator=generator, device=generator.device)]


def cycle_start(step: int, accumulation: int, micro: int, global_batch: int) -> int:
    """The run's number of the first sample of micro-batch `micro` of optimizer step `step` (module docstring)."""
    return (step * accumulation + micro) * global_batch


def cycle_levels(n: int, levels: tuple[float, ...], start: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """n noise levels [n]: `levels` taken in turn from the run's sample number `start` (flow_timesteps_mode
    'round-robin'); no draw from any generator."""
    table = torch.tensor(levels, dtype=torch.float32, device=device)
    return table[(start + torch.arange(n, device=device)) % len(levels)]
