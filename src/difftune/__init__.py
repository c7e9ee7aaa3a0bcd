"""difftune: fine-tune flow-matching diffusion models (Lumina2, Kandinsky 5)."""

__version__ = "0.1.0"
