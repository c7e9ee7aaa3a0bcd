"""Adapter formats beyond the peft LoRA that training attaches: `comfyui` converts a saved diffusers LoRA into the
key layout ComfyUI loads as is, and `lycoris` trains, saves and loads LyCORIS networks (lycoris-lora)."""
